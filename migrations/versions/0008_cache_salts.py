"""Secret prefix-cache salts per tenant, and the deployment's identity (what the disk cache tier belongs to)

Each tenant gets a random salt (32 bytes, hex) that its prefix-cache blocks are hashed with: a tenant id that
another (new or restored) database hands out again never names the same blocks. The ``deployment`` table's one
row is a random id the engines' disk tier records, so a server on another database never reads its files.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-29
"""

import secrets
from datetime import datetime, timezone

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def _random() -> str:
    return secrets.token_hex(32)


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("cache_salt", sa.String(64), nullable=True))
    tenants = sa.table("tenants", sa.column("id", sa.Integer), sa.column("cache_salt", sa.String))
    conn = op.get_bind()
    for (tenant_id,) in conn.execute(sa.select(tenants.c.id)).all():  # a fresh value each, never derived
        conn.execute(tenants.update().where(tenants.c.id == tenant_id).values(cache_salt=_random()))
    with op.batch_alter_table("tenants") as batch:
        batch.alter_column("cache_salt", existing_type=sa.String(64), nullable=False)
        batch.create_unique_constraint("uq_tenants_cache_salt", ["cache_salt"])
    deployment = op.create_table(
        "deployment",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("created_at", sa.DateTime, nullable=False),
    )
    op.bulk_insert(deployment, [{"id": _random(),
                                 "created_at": datetime.now(timezone.utc).replace(tzinfo=None)}])


def downgrade() -> None:
    op.drop_table("deployment")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_constraint("uq_tenants_cache_salt", type_="unique")
        batch.drop_column("cache_salt")
