"""Alembic environment: runs migrations on a sync connection (sqlite3 or psycopg).

``tenants.migrate`` passes the URL in ``config.attributes["url"]`` (or a ready
connection in ``config.attributes["connection"]``); plain ``alembic`` falls back
to ``sqlalchemy.url`` / MOEGATE_DATABASE_URL.
"""

from alembic import context
from sqlalchemy import create_engine, pool

from tenants.db import database_url, sync_url
from tenants.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    return sync_url(config.attributes.get("url") or config.get_main_option("sqlalchemy.url") or database_url())


def _run(connection) -> None:
    # Batch mode lets later ALTERs work on SQLite (it rebuilds the table).
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def run_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = create_engine(_url(), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
