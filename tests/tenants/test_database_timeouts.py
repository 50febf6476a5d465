"""A database that hangs makes requests fail fast with 503 ``database_unavailable``, never hang:
PostgreSQL tables locked by another session, against a real gateway on loopback."""

import asyncio
import time

import aiohttp
import psycopg
import pytest
from aiohttp.test_utils import TestServer

from benchmarks.instant_engine import InstantEngine
from gateway.app import create_app
from gateway.config import GatewayConfig
from tenants.store import TenantStore


@pytest.mark.timeout(120)
def test_locked_postgresql_tables_give_quick_503s(pg_migrated_url, tmp_path):
    from .conftest import _reset_pg

    _reset_pg(pg_migrated_url)

    async def scenario():
        store = TenantStore.open(pg_migrated_url)
        try:
            await store.create_tenant("t")
            key = (await store.create_key("t"))[1]
            await store.set_quota("t", requests_per_minute=1000)
        finally:
            await store.close()
        app = create_app(GatewayConfig(database_url=pg_migrated_url, data_dir=str(tmp_path / "data"),
                                       auth_cache_ttl_s=0.0, policy_cache_ttl_s=0.0), InstantEngine())
        async with TestServer(app, host="127.0.0.1") as server, \
                aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http:
            body = {"model": "instant", "prompt": "hello", "max_tokens": 2}
            async with http.post(server.make_url("/v1/completions"), json=body) as r:
                assert r.status == 200
            with psycopg.connect(pg_migrated_url) as locker:  # holds the locks until the block ends
                locker.execute("LOCK TABLE api_keys, tenants, quota_counters IN ACCESS EXCLUSIVE MODE")
                for _ in range(3):
                    t0 = time.monotonic()
                    async with http.post(server.make_url("/v1/completions"), json=body) as r:
                        answer = await r.json()
                    waited = time.monotonic() - t0
                    assert r.status == 503 and answer["error"]["code"] == "database_unavailable", answer
                    assert waited < 6.0, waited  # the lock timeout (2 s), not the 20 s+ of before
                    assert "Retry-After" in r.headers
            async with http.post(server.make_url("/v1/completions"), json=body) as r:
                assert r.status == 200  # the locks are gone: served again

    asyncio.run(scenario())
