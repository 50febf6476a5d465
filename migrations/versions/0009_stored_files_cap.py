"""A cap on the bytes a tenant's stored files take together (moegate admin quota set NAME --max-stored-file-bytes N)

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

DEFAULT_MAX_STORED_FILE_BYTES = 2**30  # tenants.models' default at the time: existing quota rows take it


def upgrade() -> None:
    with op.batch_alter_table("quotas") as batch:
        batch.add_column(sa.Column("max_stored_file_bytes", sa.BigInteger, nullable=True,
                                   server_default=str(DEFAULT_MAX_STORED_FILE_BYTES)))
        batch.create_check_constraint("ck_quotas_max_stored_file_bytes",
                                      "max_stored_file_bytes IS NULL OR max_stored_file_bytes >= 0")


def downgrade() -> None:
    with op.batch_alter_table("quotas") as batch:
        batch.drop_constraint("ck_quotas_max_stored_file_bytes", type_="check")
        batch.drop_column("max_stored_file_bytes")
