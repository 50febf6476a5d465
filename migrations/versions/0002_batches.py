"""Batch API: files, batches, batch lines

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer, "sqlite")
BATCH_STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                  "cancelled")
LINE_STATUSES = ("pending", "running", "done", "failed", "expired", "cancelled")


def _in(values) -> str:
    return ", ".join(f"'{v}'" for v in values)


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("tenant_id", sa.Integer, sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
        sa.Column("filename", sa.String(512), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("path", sa.String(1024), nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
    )
    op.create_index("ix_files_tenant_created", "files", ["tenant_id", "created_at"])
    op.create_table(
        "batches",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("tenant_id", sa.Integer, sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("input_file_id", sa.String(64), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("model", sa.String(256)),
        sa.Column("metadata_json", sa.String),
        sa.Column("errors_json", sa.String),
        sa.Column("output_file_id", sa.String(64)),
        sa.Column("error_file_id", sa.String(64)),
        sa.Column("total", sa.Integer, nullable=False),
        sa.Column("completed", sa.Integer, nullable=False),
        sa.Column("failed", sa.Integer, nullable=False),
        sa.Column("queued_tokens", sa.BigInteger, nullable=False),
        sa.Column("lease_owner", sa.String(64)),
        sa.Column("lease_expires", sa.Float),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("expires_at", sa.DateTime, nullable=False),
        *(sa.Column(f"{s}_at", sa.DateTime) for s in
          ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")),
        sa.CheckConstraint(f"status IN ({_in(BATCH_STATUSES)})", name="ck_batches_status"),
    )
    op.create_index("ix_batches_tenant_created", "batches", ["tenant_id", "created_at"])
    op.create_index("ix_batches_status", "batches", ["status"])
    op.create_table(
        "batch_lines",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("batch_id", sa.String(64), sa.ForeignKey("batches.id", ondelete="CASCADE"), nullable=False),
        sa.Column("line_no", sa.Integer, nullable=False),
        sa.Column("custom_id", sa.String(512), nullable=False),
        sa.Column("body_json", sa.String, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("lease_owner", sa.String(64)),
        sa.Column("lease_expires", sa.Float),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("result_json", sa.String),
        sa.CheckConstraint(f"status IN ({_in(LINE_STATUSES)})", name="ck_batch_lines_status"),
    )
    op.create_index("ux_batch_lines_custom_id", "batch_lines", ["batch_id", "custom_id"], unique=True)
    op.create_index("ix_batch_lines_claim", "batch_lines", ["status", "batch_id", "line_no"])


def downgrade() -> None:
    op.drop_table("batch_lines")
    op.drop_table("batches")
    op.drop_table("files")
