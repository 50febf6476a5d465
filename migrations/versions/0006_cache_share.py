"""A tenant's share of the prefix-cache tiers (moegate admin quota set NAME --cache-share F)

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-26
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("quotas") as batch:
        batch.add_column(sa.Column("cache_share", sa.Float, nullable=True))
        batch.create_check_constraint("ck_quotas_cache_share",
                                      "cache_share IS NULL OR (cache_share > 0 AND cache_share <= 1)")


def downgrade() -> None:
    with op.batch_alter_table("quotas") as batch:
        batch.drop_constraint("ck_quotas_cache_share", type_="check")
        batch.drop_column("cache_share")
