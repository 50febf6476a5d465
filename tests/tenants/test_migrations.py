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
