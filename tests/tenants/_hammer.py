"""Worker for the multi-process quota test: one OS process hammering one tenant's limits."""

from __future__ import annotations

import asyncio
import time

from tenants.quota import Granted, QuotaManager
from tenants.store import TenantStore, UsageRecord

RESERVE, ACTUAL = 10, 7  # reserve prompt+max_tokens, settle with fewer


def hammer(url: str, tenant_id: int, frozen_now: float, attempts: int, tasks: int, start_at: float) -> dict:
    async def main() -> dict:
        store = TenantStore.open(url, pool_size=tasks)
        qm = QuotaManager(store, clock=lambda: frozen_now)  # one window for every process
        stats = {"attempted": 0, "admitted": 0, "settled_tokens": 0}
        remaining = [attempts]

        async def worker(n: int) -> None:
            while remaining[0] > 0:
                remaining[0] -= 1
                stats["attempted"] += 1
                g = await qm.try_acquire(tenant_id, tokens=RESERVE)
                if isinstance(g, Granted):
                    stats["admitted"] += 1
                    await qm.settle(g, UsageRecord(tenant_id, f"{n}", "m", 4, ACTUAL - 4))
                    stats["settled_tokens"] += ACTUAL

        try:
            await store.list_classes()  # connect before the clock starts
            time.sleep(max(0.0, start_at - time.time()))
            t0 = time.perf_counter()
            await asyncio.gather(*(worker(i) for i in range(tasks)))
            stats["elapsed_s"] = time.perf_counter() - t0
        finally:
            await store.close()
        return stats

    return asyncio.run(main())
