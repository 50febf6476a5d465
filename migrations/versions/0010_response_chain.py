"""Stored responses as chains (each row its own input items and a link to the response it continued), their
sizes, and a per-tenant cap on them (moegate admin quota set NAME --stored-response-bytes N)

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-29
"""

import json

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

DEFAULT_STORED_RESPONSE_BYTES = 256 * 2**20  # tenants.models' default when this revision was written


def _size(*texts: str) -> int:
    return sum(len(t.encode()) for t in texts)


def upgrade() -> None:
    with op.batch_alter_table("quotas") as batch:
        batch.add_column(sa.Column("stored_response_bytes", sa.BigInteger, nullable=True))
        batch.create_check_constraint("ck_quotas_stored_response_bytes",
                                      "stored_response_bytes IS NULL OR stored_response_bytes >= 0")
    op.execute(sa.text("UPDATE quotas SET stored_response_bytes = :cap").bindparams(cap=DEFAULT_STORED_RESPONSE_BYTES))
    with op.batch_alter_table("responses") as batch:
        batch.add_column(sa.Column("parent_id", sa.String(64), nullable=True))
        batch.add_column(sa.Column("input_json", sa.String, nullable=True))
        batch.add_column(sa.Column("stored_bytes", sa.BigInteger, nullable=True))
    # An existing row held its whole conversation, its own output last: it becomes a chain of one, whose input
    # items are that conversation up to its output (which its response object holds). One row at a time.
    conn = op.get_bind()
    for (rid,) in conn.execute(sa.text("SELECT id FROM responses")).fetchall():
        response_json, conversation_json = conn.execute(
            sa.text("SELECT response_json, conversation_json FROM responses WHERE id = :id"), {"id": rid}).one()
        conversation = json.loads(conversation_json)
        inputs = json.dumps(conversation[:len(conversation) - len(json.loads(response_json)["output"])])
        conn.execute(sa.text("UPDATE responses SET input_json = :inputs, stored_bytes = :size WHERE id = :id"),
                     {"inputs": inputs, "size": _size(response_json, inputs), "id": rid})
    with op.batch_alter_table("responses") as batch:
        batch.alter_column("input_json", existing_type=sa.String, nullable=False)
        batch.alter_column("stored_bytes", existing_type=sa.BigInteger, nullable=False)
        batch.drop_column("conversation_json")
    op.create_index("ix_responses_tenant", "responses", ["tenant_id"])


def downgrade() -> None:
    op.drop_index("ix_responses_tenant", "responses")
    with op.batch_alter_table("responses") as batch:
        batch.add_column(sa.Column("conversation_json", sa.String, nullable=True))
    # Each row's whole conversation again: its chain's items (what is left of it), its inputs, its output.
    conn = op.get_bind()
    rows = {rid: (parent, response_json, input_json) for rid, parent, response_json, input_json in conn.execute(
        sa.text("SELECT id, parent_id, response_json, input_json FROM responses")).fetchall()}
    whole: dict[str, list] = {}

    def conversation(rid: str) -> list:
        chain = []
        while rid in rows and rid not in whole:
            chain.append(rid)
            rid = rows[rid][0]
        items = list(whole.get(rid, []))
        for link in reversed(chain):
            _, response_json, input_json = rows[link]
            items = items + json.loads(input_json) + json.loads(response_json)["output"]
            whole[link] = items
        return items

    for rid in rows:
        conn.execute(sa.text("UPDATE responses SET conversation_json = :c WHERE id = :id"),
                     {"c": json.dumps(conversation(rid)), "id": rid})
    with op.batch_alter_table("responses") as batch:
        batch.alter_column("conversation_json", existing_type=sa.String, nullable=False)
        batch.drop_column("stored_bytes")
        batch.drop_column("input_json")
        batch.drop_column("parent_id")
    with op.batch_alter_table("quotas") as batch:
        batch.drop_constraint("ck_quotas_stored_response_bytes", type_="check")
        batch.drop_column("stored_response_bytes")
