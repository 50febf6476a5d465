"""Database URLs, engines and the schema version check.

Users give one URL (``sqlite:///./moegate.db``, ``postgresql://user@host/db``);
the store needs its async driver (aiosqlite, asyncpg) and Alembic its sync one
(sqlite3, psycopg), so both are derived here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

DEFAULT_DATABASE_URL = "sqlite:///./moegate.db"
ENV_VAR = "MOEGATE_DATABASE_URL"


class SchemaError(RuntimeError):
    """The database schema is not the one this moegate was built for."""


def database_url(explicit: str | None = None) -> str:
    return explicit or os.environ.get(ENV_VAR) or DEFAULT_DATABASE_URL


def backend(url: str) -> str:
    """``sqlite`` or ``postgresql``; anything else is bad input."""
    name = make_url(url).get_backend_name()
    if name in ("sqlite", "postgresql"):
        return name
    raise ValueError(f"unsupported database URL {url!r}: use sqlite:///PATH or postgresql://...")


def _with_driver(url: str, drivers: dict[str, str]) -> str:
    u = make_url(url)
    return u.set(drivername=f"{backend(url)}+{drivers[backend(url)]}").render_as_string(hide_password=False)


def async_url(url: str) -> str:
    return _with_driver(url, {"sqlite": "aiosqlite", "postgresql": "asyncpg"})


def sync_url(url: str) -> str:
    return _with_driver(url, {"sqlite": "pysqlite", "postgresql": "psycopg"})


@dataclass(frozen=True, slots=True)
class DatabaseTimeouts:
    """How long a request may wait on the database before it is answered 503 ``database_unavailable``.

    A database that hangs (a locked table, a dead network path, an exhausted pool) must not make
    requests hang: each wait below ends in an error the gateway turns into a quick 503.
    """

    connect_s: float = 5.0  # opening a connection
    lock_s: float = 2.0  # waiting for a row or table lock (PostgreSQL)
    sqlite_busy_s: float = 5.0  # waiting for SQLite's write lock (a 50,000-line batch holds it a while)
    statement_s: float = 15.0  # one statement (PostgreSQL); generous: creating a batch inserts 50,000 lines
    pool_s: float = 5.0  # waiting for a free connection of the pool

    def postgres_options(self) -> str:
        """libpq ``options``: the server cancels statements and lock waits past their limits."""
        return f"-c statement_timeout={int(self.statement_s * 1000)} -c lock_timeout={int(self.lock_s * 1000)}"


DEFAULT_TIMEOUTS = DatabaseTimeouts()


def create_engine_for(url: str, timeouts: DatabaseTimeouts = DEFAULT_TIMEOUTS, **kwargs) -> AsyncEngine:
    """An async engine for the store; SQLite gets foreign keys and write-locking transactions."""
    kwargs = {"pool_timeout": timeouts.pool_s, **kwargs}
    if backend(url) == "sqlite":
        # One connection per process: SQLite has one writer at a time anyway, and queueing for the
        # pool in asyncio is fair and cheap where several connections would spin in SQLite's busy wait.
        kwargs = {"pool_size": 1, "max_overflow": 0, **kwargs}
        engine = create_async_engine(async_url(url), connect_args={"timeout": timeouts.sqlite_busy_s}, **kwargs)
        sqlite_pragmas(engine.sync_engine)
        return engine
    server_settings = {"statement_timeout": str(int(timeouts.statement_s * 1000)),
                       "lock_timeout": str(int(timeouts.lock_s * 1000))}
    return create_async_engine(async_url(url), connect_args={"timeout": timeouts.connect_s,
                                                             "server_settings": server_settings}, **kwargs)


def sqlite_pragmas(sync_engine) -> None:
    @event.listens_for(sync_engine, "connect")
    def _connect(dbapi_connection, _record):
        # Let SQLAlchemy, not the driver, emit BEGIN (see "begin" below).
        dbapi_connection.isolation_level = None
        cur = dbapi_connection.cursor()
        cur.execute("PRAGMA foreign_keys=ON")
        # WAL: readers never wait for the writer, and a commit is one append (synchronous=NORMAL keeps
        # it durable across a crash of the process; only a power cut may lose the last commits).
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    @event.listens_for(sync_engine, "begin")
    def _begin(conn):
        # BEGIN IMMEDIATE takes the write lock up front: two connections can never both read a
        # counter and then both fail to upgrade to a write lock (SQLITE_BUSY deadlock).
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def is_embedded_default(url: str) -> bool:
    return backend(url) == "sqlite"
