import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect, pool, text

from tenants import migrate
from tenants.db import SchemaError, sync_url
from tenants.models import Base

TABLES = {"priority_classes", "tenants", "api_keys", "quotas", "usage", "quota_counters", "adapters",
          "adapter_grants", "alembic_version"}


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'empty.db'}"
    return request.getfixturevalue("pg_server").create_database()


def _tables(url):
    engine = create_engine(sync_url(url), poolclass=pool.NullPool)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_every_migration_runs_up_and_down(empty_url):
    assert migrate.current_revision(empty_url) is None
    migrate.upgrade(empty_url)
    assert migrate.current_revision(empty_url) == migrate.head_revision()
    assert TABLES <= _tables(empty_url)
    migrate.downgrade(empty_url, "base")
    assert migrate.current_revision(empty_url) is None
    assert _tables(empty_url) <= {"alembic_version"}
    migrate.upgrade(empty_url)  # and up again, over what the downgrade left
    assert migrate.current_revision(empty_url) == migrate.head_revision()


def test_models_match_migrations(db_url):
    engine = create_engine(sync_url(db_url), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    finally:
        engine.dispose()
    assert diff == []


def test_first_migration_seeds_priority_classes(db_url):
    engine = create_engine(sync_url(db_url), poolclass=pool.NullPool)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT name, rank, preemptible, may_preempt FROM priority_classes ORDER BY rank"))
        assert [tuple(r) for r in rows] == [
            ("realtime", 0, False, True), ("standard", 1, True, True), ("batch", 2, True, False)]
    engine.dispose()


def test_ensure_schema_refuses_old_schema_on_postgresql(pg_server):
    url = pg_server.create_database()
    with pytest.raises(SchemaError) as e:
        migrate.ensure_schema(url)
    assert "moegate db upgrade" in str(e.value) and "\n" not in str(e.value)
    migrate.upgrade(url)
    migrate.ensure_schema(url)  # at head: fine


def test_ensure_schema_upgrades_embedded_sqlite(tmp_path):
    url = f"sqlite:///{tmp_path / 'auto.db'}"
    with pytest.raises(SchemaError):
        migrate.ensure_schema(url, auto_upgrade_sqlite=False)
    migrate.ensure_schema(url)
    assert migrate.current_revision(url) == migrate.head_revision()


def test_script_location_does_not_depend_on_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    migrate.upgrade("sqlite:///elsewhere.db")
    assert (tmp_path / "elsewhere.db").exists()


def test_response_chain_migration_keeps_stored_conversations(empty_url):
    """A response stored whole (its conversation, its output last) before the chain layout: after the upgrade
    its inputs are the conversation up to its output and its size is counted; existing tenants get the default
    stored-response cap; the downgrade gives the whole conversation back, a follow-up's included."""
    import json
    import random

    from tenants.models import DEFAULT_STORED_RESPONSE_BYTES

    migrate.upgrade(empty_url, "0007")
    output = [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": "é" * random.randint(5, 50), "annotations": []}]}]
    inputs = [{"type": "message", "id": "msg_0", "role": "user", "content": "x" * random.randint(5, 50)}]
    response = json.dumps({"id": "resp_1", "object": "response", "output": output})
    engine = create_engine(sync_url(empty_url), poolclass=pool.NullPool)
    try:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO tenants (name, priority_class, weight, status, created_at, updated_at) "
                              "VALUES ('t', 'standard', 1.0, 'active', '2026-01-01', '2026-01-01')"))
            conn.execute(text("INSERT INTO quotas (tenant_id, batch_discount) VALUES (1, 0.5)"))
            conn.execute(text("INSERT INTO responses VALUES ('resp_1', 1, :r, :c, '2026-01-01', '2099-01-01')"),
                         {"r": response, "c": json.dumps(inputs + output)})
        migrate.upgrade(empty_url)
        with engine.connect() as conn:
            row = conn.execute(text("SELECT input_json, stored_bytes, parent_id FROM responses")).one()
            cap = conn.execute(text("SELECT stored_response_bytes FROM quotas")).scalar_one()
        assert json.loads(row[0]) == inputs and row[2] is None and cap == DEFAULT_STORED_RESPONSE_BYTES
        assert row[1] == len(response.encode()) + len(row[0].encode())
        with engine.begin() as conn:  # a follow-up stored in the new layout
            conn.execute(text("INSERT INTO responses (id, tenant_id, parent_id, response_json, input_json, stored_bytes,"
                              " created_at, expires_at) VALUES ('resp_2', 1, 'resp_1', :r, :i, 1, '2026-01-02', "
                              "'2099-01-01')"), {"r": json.dumps({"id": "resp_2", "output": output}),
                                                 "i": json.dumps(inputs)})
        migrate.downgrade(empty_url, "0007")
        with engine.connect() as conn:
            rows = dict(conn.execute(text("SELECT id, conversation_json FROM responses")).all())
        assert json.loads(rows["resp_1"]) == inputs + output
        assert json.loads(rows["resp_2"]) == (inputs + output) * 2
    finally:
        engine.dispose()
