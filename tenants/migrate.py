"""Run the Alembic migrations in ``migrations/`` and check the schema version.

The script location is the installed ``migrations`` package, never the cwd, so
``moegate db upgrade`` works from any directory.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, pool

from tenants.db import SchemaError, is_embedded_default, sync_url


def _script_location() -> str:
    """The installed ``migrations`` folder, found without importing it: it is Alembic's script
    directory (its env.py imports the tenants models), not a module tenants uses."""
    spec = importlib.util.find_spec("migrations")
    return str(Path(next(iter(spec.submodule_search_locations))).resolve())


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", _script_location())
    cfg.attributes["url"] = url
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "-1") -> None:
    command.downgrade(alembic_config(url), revision)


def head_revision() -> str:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def current_revision(url: str) -> str | None:
    engine = create_engine(sync_url(url), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def ensure_schema(url: str, *, auto_upgrade_sqlite: bool = True) -> None:
    """Raise ``SchemaError`` (a one-line message) unless the schema is at head.

    The gateway calls this before it starts. An embedded SQLite database is
    upgraded in place instead, since nothing else shares it.
    """
    current, head = current_revision(url), head_revision()
    if current == head:
        return
    if auto_upgrade_sqlite and is_embedded_default(url):
        upgrade(url)
        return
    shown = current or "empty"
    raise SchemaError(f"database schema is at {shown}, this moegate needs {head}: run `moegate db upgrade`")
