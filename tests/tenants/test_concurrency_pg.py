"""Several OS processes share one tenant's limits on PostgreSQL: never more than the limit, no lost tokens."""

import asyncio
import multiprocessing
import time
from datetime import date

import pytest

from tenants.quota import CONCURRENCY_WINDOW, QuotaManager
from tenants.store import TenantStore

from ._hammer import ACTUAL, RESERVE, hammer

PROCESSES, TASKS, ATTEMPTS = 3, 4, 120


def _run_processes(url: str, tenant_id: int, now: float) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no event loop or pool crosses a fork
    start_at = time.time() + 3.0
    with ctx.Pool(PROCESSES) as pool:
        results = [pool.apply_async(hammer, (url, tenant_id, now, ATTEMPTS, TASKS, start_at)) for _ in range(PROCESSES)]
        return [r.get(timeout=120) for r in results]


async def _counters(url: str, tenant_id: int, now: float) -> dict:
    store = TenantStore.open(url)
    try:
        qm = QuotaManager(store)
        minute = int(now // 60 * 60)
        g = await QuotaManager(store, clock=lambda: now).try_acquire(tenant_id, requests=0, tokens=0)
        return {
            "rpm": await qm.counter(tenant_id, "rpm", minute),
            "tpm": await qm.counter(tenant_id, "tpm", minute),
            "conc": await qm.counter(tenant_id, "conc", CONCURRENCY_WINDOW),
            "day": await qm.counter(tenant_id, "day", g.day),
            "ledger": await store.billed_since(tenant_id, date(2000, 1, 1)),
            "rows": sum(r["requests"] for r in await store.usage_summary(tenant_id, by="tenant")),
        }
    finally:
        await store.close()


def _setup(url: str, **limits) -> int:
    async def go():
        store = TenantStore.open(url)
        try:
            t = await store.create_tenant("hammered")
            await store.set_quota(t.id, **limits)
            return t.id
        finally:
            await store.close()

    return asyncio.run(go())


def _report(name: str, results: list[dict], limit: int) -> tuple[int, int]:
    attempted = sum(r["attempted"] for r in results)
    admitted = sum(r["admitted"] for r in results)
    wall = max(r["elapsed_s"] for r in results)
    print(f"\n[{name}] {PROCESSES} processes x {TASKS} tasks: attempted={attempted} admitted={admitted} "
          f"limit={limit} wall={wall:.2f}s ops/s={attempted / wall:.0f}")
    return attempted, admitted


@pytest.mark.parametrize("kind", ["rpm", "tpm"])
def test_processes_never_exceed_limits_on_postgresql(pg_migrated_url, kind, capsys):
    from .conftest import _reset_pg

    _reset_pg(pg_migrated_url)
    now = time.time()
    if kind == "rpm":
        limit = 150
        tenant_id = _setup(pg_migrated_url, requests_per_minute=limit, tokens_per_minute=10**9, daily_tokens=10**9)
    else:
        limit = 700  # tokens/min; reservations of 10 settle to 7, so up to 100 may get in
        tenant_id = _setup(pg_migrated_url, tokens_per_minute=limit, max_concurrency=5)
    results = _run_processes(pg_migrated_url, tenant_id, now)
    with capsys.disabled():
        attempted, admitted = _report(kind, results, limit)
    c = asyncio.run(_counters(pg_migrated_url, tenant_id, now))
    assert attempted == PROCESSES * ATTEMPTS
    assert c["conc"] == 0  # every slot given back
    assert c["rows"] == admitted  # one ledger row per admitted request
    assert c["tpm"] == ACTUAL * admitted == sum(r["settled_tokens"] for r in results)  # no settled token lost
    assert c["day"] == c["ledger"] == ACTUAL * admitted
    if kind == "rpm":
        assert admitted == limit == c["rpm"]  # exactly the limit: never more, and no lost grants
    else:
        assert ACTUAL * admitted <= limit
        assert admitted >= limit // RESERVE
