"""LoRA adapters as tenant-owned things (moegate admin adapter ...), their grants, and the adapter of each usage row

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "adapters",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("path", sa.String(1024), nullable=False),
        # NULL: public (every tenant may use it)
        sa.Column("owner_tenant_id", sa.Integer, sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=True),
        sa.Column("rank", sa.Integer, nullable=False),
        sa.Column("target_modules", sa.String(512), nullable=False),
        sa.Column("base_model", sa.String(1024), nullable=True),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.CheckConstraint("rank > 0", name="ck_adapters_rank"),
    )
    op.create_table(
        "adapter_grants",
        sa.Column("adapter_id", sa.Integer, sa.ForeignKey("adapters.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("tenant_id", sa.Integer, sa.ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("created_at", sa.DateTime, nullable=False),
    )
    op.create_index("ix_adapter_grants_tenant", "adapter_grants", ["tenant_id"])
    with op.batch_alter_table("usage") as batch:
        batch.add_column(sa.Column("adapter", sa.String(128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage") as batch:
        batch.drop_column("adapter")
    op.drop_index("ix_adapter_grants_tenant", "adapter_grants")
    op.drop_table("adapter_grants")
    op.drop_table("adapters")
