"""A tenant's image limits: images per chat request and decoded pixels per image (moegate admin quota set NAME
--max-images-per-request N --max-image-pixels N); NULL: the gateway's own limits

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

FIELDS = ("max_images_per_request", "max_image_pixels")


def upgrade() -> None:
    # Existing tenants keep today's behaviour: no limit of their own (NULL), the gateway's apply.
    with op.batch_alter_table("quotas") as batch:
        for name in FIELDS:
            batch.add_column(sa.Column(name, sa.BigInteger, nullable=True))
            batch.create_check_constraint(f"ck_quotas_{name}", f"{name} IS NULL OR {name} >= 0")


def downgrade() -> None:
    with op.batch_alter_table("quotas") as batch:
        for name in reversed(FIELDS):
            batch.drop_constraint(f"ck_quotas_{name}", type_="check")
            batch.drop_column(name)
