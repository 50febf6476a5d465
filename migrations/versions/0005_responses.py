"""Stored Responses API responses (previous_response_id, GET /v1/responses/{id})

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-26
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("tenant_id", sa.Integer, sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
        sa.Column("response_json", sa.String, nullable=False),
        sa.Column("conversation_json", sa.String, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("expires_at", sa.DateTime, nullable=False),
    )
    op.create_index("ix_responses_expires", "responses", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_responses_expires", "responses")
    op.drop_table("responses")
