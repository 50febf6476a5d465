"""Service-level objectives per priority class (moegate admin class set NAME --ttft-slo-ms N --itl-slo-ms N
--slo-action refuse|queue), and each usage row's class and whether it met them

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("priority_classes") as batch:
        batch.add_column(sa.Column("ttft_slo_ms", sa.Integer, nullable=True))
        batch.add_column(sa.Column("itl_slo_ms", sa.Integer, nullable=True))
        # Existing classes keep today's behaviour: no objectives, and a request that would miss one waits.
        batch.add_column(sa.Column("slo_action", sa.String(8), nullable=False, server_default="queue"))
        batch.create_check_constraint("ck_priority_classes_ttft_slo_ms", "ttft_slo_ms IS NULL OR ttft_slo_ms > 0")
        batch.create_check_constraint("ck_priority_classes_itl_slo_ms", "itl_slo_ms IS NULL OR itl_slo_ms > 0")
        batch.create_check_constraint("ck_priority_classes_slo_action", "slo_action IN ('refuse', 'queue')")
    # Rows written before this revision have no class and no verdict (NULL): the ledger cannot know them.
    with op.batch_alter_table("usage") as batch:
        batch.add_column(sa.Column("priority_class", sa.String(64), nullable=True))
        batch.add_column(sa.Column("slo_met", sa.Boolean, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage") as batch:
        batch.drop_column("slo_met")
        batch.drop_column("priority_class")
    with op.batch_alter_table("priority_classes") as batch:
        batch.drop_constraint("ck_priority_classes_slo_action", type_="check")
        batch.drop_constraint("ck_priority_classes_itl_slo_ms", type_="check")
        batch.drop_constraint("ck_priority_classes_ttft_slo_ms", type_="check")
        batch.drop_column("slo_action")
        batch.drop_column("itl_slo_ms")
        batch.drop_column("ttft_slo_ms")
