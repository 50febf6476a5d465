"""Backends for the tenants tests: every ``db_url`` test runs on SQLite and on PostgreSQL.

PostgreSQL is 127.0.0.1:5432 (trust auth, user postgres or root); each test
session makes its own database and drops it at the end. Unreachable: skip with
a reason, or fail when CI=true.
"""

from __future__ import annotations

import os
import shutil
import uuid

import pytest

from tenants import migrate

PG_HOST = os.environ.get("MOEGATE_TEST_PG_HOST", "127.0.0.1")
PG_PORT = int(os.environ.get("MOEGATE_TEST_PG_PORT", "5432"))
PG_USERS = ("postgres", "root")
TABLES = "adapter_grants, adapters, responses, batch_lines, batches, files, usage, quota_counters, quotas, api_keys, tenants"


def _pg_connect(dbname: str = "test"):
    import psycopg

    last = None
    for user in PG_USERS:
        try:
            return psycopg.connect(host=PG_HOST, port=PG_PORT, user=user, dbname=dbname, connect_timeout=3,
                                   autocommit=True), user
        except psycopg.OperationalError as e:
            last = e
    raise last


def _pg_unavailable(reason: str):
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"PostgreSQL required on CI but unreachable: {reason}")
    pytest.skip(f"PostgreSQL at {PG_HOST}:{PG_PORT} unreachable ({reason}); set CI=true to make this a failure")


class PgServer:
    """Creates and drops uniquely named databases on the test server."""

    def __init__(self) -> None:
        self.conn, self.user = _pg_connect()
        self.created: list[str] = []

    def create_database(self) -> str:
        name = f"moegate_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self.conn.execute(f'CREATE DATABASE "{name}"')
        self.created.append(name)
        return f"postgresql://{self.user}@{PG_HOST}:{PG_PORT}/{name}"

    def drop_all(self) -> None:
        for name in self.created:
            self.conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        self.conn.close()


@pytest.fixture(scope="session")
def pg_server():
    try:
        server = PgServer()
    except Exception as e:  # noqa: BLE001 - any failure to connect means "no PostgreSQL here"
        _pg_unavailable(" ".join(str(e).split())[:200])
    yield server
    server.drop_all()


@pytest.fixture(scope="session")
def pg_migrated_url(pg_server) -> str:
    url = pg_server.create_database()
    migrate.upgrade(url)
    return url


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("sqlite") / "template.db"
    migrate.upgrade(f"sqlite:///{path}")
    return str(path)


def _reset_pg(url: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE")
        conn.execute("DELETE FROM priority_classes WHERE name NOT IN ('realtime', 'standard', 'batch')")
        conn.execute("""UPDATE priority_classes SET default_weight = 1.0,
            rank = CASE name WHEN 'realtime' THEN 0 WHEN 'standard' THEN 1 ELSE 2 END,
            preemptible = name <> 'realtime', may_preempt = name <> 'batch',
            ttft_slo_ms = NULL, itl_slo_ms = NULL, slo_action = 'queue'""")


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path) -> str:
    """A migrated, empty database (seeded classes only) on each backend."""
    if request.param == "sqlite":
        path = tmp_path / "moegate.db"
        shutil.copy(request.getfixturevalue("sqlite_template"), path)
        return f"sqlite:///{path}"
    url = request.getfixturevalue("pg_migrated_url")
    _reset_pg(url)
    return url
