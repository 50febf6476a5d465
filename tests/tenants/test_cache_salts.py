"""Tenants' prefix-cache salts and the deployment's identity: random, never another tenant's (in this database
or any other), kept across restarts, filled in by the migration for tenants made before it, never shown."""

import re

import pytest
from sqlalchemy import create_engine, pool, text

from tenants import migrate
from tenants.db import sync_url

from .helpers import cli, with_store

SECRET = re.compile(r"[0-9a-f]{64}")


def test_salts_are_random_per_tenant_unique_and_kept(db_url, tmp_path):
    async def make(store):
        infos = [await store.create_tenant(f"t{i}") for i in range(6)]
        return {t.id: await store.cache_salt(t.id) for t in infos}, await store.deployment_id()

    salts, deployment = with_store(db_url, make)
    assert all(SECRET.fullmatch(s) for s in salts.values()) and SECRET.fullmatch(deployment)
    assert len(set(salts.values())) == len(salts)
    assert all(s != str(i) for i, s in salts.items())
    # A restart (a new store over the same database) reads the same values.
    again = with_store(db_url, lambda store: _salts_and_deployment(store, salts))
    assert again == (salts, deployment)
    # Another database hands out the same ids again, never the same salts or identity.
    other = f"sqlite:///{tmp_path / 'other.db'}"
    migrate.upgrade(other)
    theirs, their_deployment = with_store(other, make)
    assert set(theirs) == set(salts) and not set(theirs.values()) & set(salts.values())
    assert their_deployment != deployment


async def _salts_and_deployment(store, salts):
    return {i: await store.cache_salt(i) for i in salts}, await store.deployment_id()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_migration_fills_existing_tenants_with_fresh_salts(tmp_path, request, backend):
    """Two databases with the same tenants before the migration get different salts from it."""
    found = []
    for name in ("a", "b"):
        url = (f"sqlite:///{tmp_path / name}.db" if backend == "sqlite"
               else request.getfixturevalue("pg_server").create_database())
        migrate.upgrade(url, "0007")
        engine = create_engine(sync_url(url), poolclass=pool.NullPool)
        with engine.begin() as conn:
            for i in range(3):
                conn.execute(text("INSERT INTO tenants (name, priority_class, weight, status, created_at, updated_at) "
                                  "VALUES (:n, 'standard', 1.0, 'active', '2026-01-01', '2026-01-01')"),
                             {"n": f"t{i}"})
        migrate.upgrade(url)
        with engine.connect() as conn:
            found.append(dict(conn.execute(text("SELECT id, cache_salt FROM tenants")).all()))
        engine.dispose()
    assert set(found[0]) == set(found[1]) == {1, 2, 3}
    for salts in found:
        assert all(SECRET.fullmatch(s) for s in salts.values()) and len(set(salts.values())) == 3
    assert not set(found[0].values()) & set(found[1].values())


def test_salts_are_never_shown(db_url, capsys):
    code, made, _ = cli(capsys, db_url, "admin", "tenant", "create", "acme", as_json=True)
    salt = with_store(db_url, lambda store: store.cache_salt(made["id"]))
    outputs = [cli(capsys, db_url, "admin", "tenant", "create", "beta", as_json=True)[1]]
    for argv in (("admin", "tenant", "list"), ("admin", "tenant", "show", "acme")):
        outputs += [cli(capsys, db_url, *argv)[1], cli(capsys, db_url, *argv, as_json=True)[1]]
    assert code == 0 and all(salt not in str(out) and "cache_salt" not in str(out) for out in [made] + outputs)
