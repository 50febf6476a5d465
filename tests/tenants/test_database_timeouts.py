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

from .helpers import tenant_key


@pytest.mark.timeout(120)
def test_locked_postgresql_tables_give_quick_503s(pg_migrated_url, tmp_path):
    from .conftest import _reset_pg

    _reset_pg(pg_migrated_url)

    async def scenario():
        key = await tenant_key(pg_migrated_url, requests_per_minute=1000)
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


@pytest.mark.timeout(120)
def test_usage_settled_while_the_database_is_down_is_written_at_the_next_start(pg_migrated_url, tmp_path):
    """The gateway stops during an outage (tables locked): its unwritten usage goes to the journal under
    the data directory, and the next start writes it, each request billed exactly once."""
    from gateway.usage_ledger import UsageLedger
    from tenants.quota import QuotaManager
    from tenants.store import UsageRecord

    from .conftest import _reset_pg

    _reset_pg(pg_migrated_url)
    journal = tmp_path / "data" / "usage-journal"

    async def scenario():
        store = TenantStore.open(pg_migrated_url)
        try:
            t = await store.create_tenant("t")
            await store.set_quota("t", tokens_per_minute=10**6, max_concurrency=1000)
            quotas = QuotaManager(store)
            grants = [await quotas.try_acquire(t.id, tokens=50) for _ in range(40)]
            ledger = UsageLedger(quotas, retry_s=0.05, journal_dir=journal)
            ledger.close_attempts = 2
            ledger.start()
            with psycopg.connect(pg_migrated_url) as locker:
                locker.execute("LOCK TABLE usage, quota_counters IN ACCESS EXCLUSIVE MODE")
                for i, g in enumerate(grants):
                    ledger.submit(g, UsageRecord(t.id, f"r{i}", "m", 10, 5 + i % 3))
                await ledger.close()  # gives up on the locked database: the settles go to the journal
                assert len(list(journal.glob("usage-*.json"))) == 1
            assert await store.usage_summary("t", by="tenant") == []  # nothing was written

            again = UsageLedger(quotas, journal_dir=journal)  # the next start
            assert await again.replay_journal() == 40
            assert list(journal.glob("*")) == []
            assert await again.replay_journal() == 0  # replayed once, never twice
            (row,) = await store.usage_summary("t", by="tenant")
            assert row["requests"] == 40
            assert row["completion_tokens"] == sum(5 + i % 3 for i in range(40))
        finally:
            await store.close()

    asyncio.run(scenario())
