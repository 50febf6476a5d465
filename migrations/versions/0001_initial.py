"""tenants, api keys, quotas, priority classes, usage ledger, quota counters

Revision ID: 0001
Revises:
Create Date: 2025-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer, "sqlite")
LIMITS = (
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrency",
    "max_tokens_per_request",
    "daily_tokens",
    "monthly_tokens",
    "max_batch_queue_tokens",
)


def upgrade() -> None:
    classes = op.create_table(
        "priority_classes",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("rank", sa.Integer, nullable=False),
        sa.Column("default_weight", sa.Float, nullable=False),
        sa.Column("preemptible", sa.Boolean, nullable=False),
        sa.Column("may_preempt", sa.Boolean, nullable=False),
        sa.CheckConstraint("rank >= 0", name="ck_priority_classes_rank"),
        sa.CheckConstraint("default_weight > 0", name="ck_priority_classes_weight"),
    )
    # realtime is never preempted; standard yields to realtime; batch yields to everyone.
    op.bulk_insert(
        classes,
        [
            {"name": "realtime", "rank": 0, "default_weight": 1.0, "preemptible": False, "may_preempt": True},
            {"name": "standard", "rank": 1, "default_weight": 1.0, "preemptible": True, "may_preempt": True},
            {"name": "batch", "rank": 2, "default_weight": 1.0, "preemptible": True, "may_preempt": False},
        ],
    )
    op.create_table(
        "tenants",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column(
            "priority_class",
            sa.String(64),
            sa.ForeignKey("priority_classes.name", onupdate="CASCADE"),
            nullable=False,
        ),
        sa.Column("weight", sa.Float, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("updated_at", sa.DateTime, nullable=False),
        sa.UniqueConstraint("name", name="uq_tenants_name"),
        sa.CheckConstraint("status IN ('active', 'disabled')", name="ck_tenants_status"),
        sa.CheckConstraint("weight > 0", name="ck_tenants_weight"),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("tenant_id", sa.Integer, sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
        sa.Column("label", sa.String(128)),
        sa.Column("prefix", sa.String(8), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("last_used_at", sa.DateTime),
        sa.Column("revoked_at", sa.DateTime),
        sa.UniqueConstraint("key_hash", name="uq_api_keys_key_hash"),
    )
    op.create_index("ix_api_keys_tenant_id", "api_keys", ["tenant_id"])
    op.create_table(
        "quotas",
        sa.Column("tenant_id", sa.Integer, sa.ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True),
        *[sa.Column(name, sa.BigInteger) for name in LIMITS],
        sa.Column("batch_discount", sa.Float, nullable=False, server_default="0.5"),
        *[sa.CheckConstraint(f"{f} IS NULL OR {f} >= 0", name=f"ck_quotas_{f}") for f in LIMITS],
        sa.CheckConstraint("batch_discount >= 0 AND batch_discount <= 1", name="ck_quotas_batch_discount"),
    )
    op.create_table(
        "usage",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("tenant_id", sa.Integer, sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
        sa.Column("key_id", sa.Integer, sa.ForeignKey("api_keys.id", ondelete="SET NULL")),
        sa.Column("request_id", sa.String(64), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger, nullable=False),
        sa.Column("cached_prompt_tokens", sa.BigInteger, nullable=False),
        sa.Column("completion_tokens", sa.BigInteger, nullable=False),
        sa.Column("billed_tokens", sa.BigInteger, nullable=False),
        sa.Column("batch", sa.Boolean, nullable=False),
        sa.Column("finish_reason", sa.String(32)),
        sa.Column("http_status", sa.Integer, nullable=False),
        sa.Column("started_at", sa.DateTime, nullable=False),
        sa.Column("finished_at", sa.DateTime, nullable=False),
        sa.Column("day", sa.Date, nullable=False),
    )
    op.create_index("ix_usage_tenant_day", "usage", ["tenant_id", "day"])
    op.create_index("ix_usage_day", "usage", ["day"])
    op.create_table(
        "quota_counters",
        sa.Column("tenant_id", sa.Integer, sa.ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("kind", sa.String(8), primary_key=True),
        sa.Column("window", sa.BigInteger, primary_key=True),
        sa.Column("value", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("quota_counters")
    op.drop_index("ix_usage_day", table_name="usage")
    op.drop_index("ix_usage_tenant_day", table_name="usage")
    op.drop_table("usage")
    op.drop_table("quotas")
    op.drop_index("ix_api_keys_tenant_id", table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_table("tenants")
    op.drop_table("priority_classes")
