"""The usage ledger writer: batched, retried on failure, nothing lost at close."""

import asyncio
import random

from gateway.usage_ledger import UsageLedger
from tenants.migrate import upgrade
from tenants.quota import Granted, QuotaManager
from tenants.store import TenantStore, UsageRecord


def with_ledger_db(tmp_path, body) -> None:
    """Run ``await body(store)`` against a fresh migrated SQLite file; the store is closed afterwards."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    upgrade(url)

    async def main():
        store = TenantStore.open(url)
        try:
            await body(store)
        finally:
            await store.close()

    asyncio.run(main())


def test_ledger_batches_retries_and_flushes_everything_on_close(tmp_path):
    async def body(store):
        t = await store.create_tenant("acme")
        await store.set_quota("acme", tokens_per_minute=10**6, max_concurrency=1000)
        quotas = QuotaManager(store)
        real = quotas.settle_many
        failures = 2

        async def flaky(items):  # the database fails twice, then recovers
            nonlocal failures
            if failures:
                failures -= 1
                raise OSError("database went away")
            return await real(items)

        quotas.settle_many = flaky
        ledger = UsageLedger(quotas, max_batch=64, retry_s=0.01)
        rng = random.Random()
        expected = 0
        grants = [await quotas.try_acquire(t.id, tokens=100) for _ in range(300)]
        assert all(isinstance(g, Granted) for g in grants)
        ledger.start()
        for i, g in enumerate(grants):  # requests finish in bursts, as on a busy server
            if i % 10 == 9:
                ledger.submit(g, None)  # never ran: released
            else:
                u = UsageRecord(t.id, f"r{i}", "m", rng.randint(1, 50), rng.randint(0, 50))
                expected += u.prompt_tokens + u.completion_tokens
                ledger.submit(g, u)
            if i % 30 == 29:
                await asyncio.sleep(0.005)
        await ledger.close()
        assert ledger.backlog == 0 and ledger.settled == 300
        assert ledger.flushes < 300 / 2  # batched: far fewer transactions than requests
        rows = await store.usage_summary("acme", by="tenant")
        assert rows[0]["requests"] == 270
        assert rows[0]["prompt_tokens"] + rows[0]["completion_tokens"] == expected
        assert await quotas.counter(t.id, "conc", 0) == 0  # every slot came back
        # reservations replaced by usage (summed over windows: the grants may straddle a minute boundary)
        minutes = {g.minute for g in grants}
        assert sum([await quotas.counter(t.id, "tpm", m) for m in minutes]) == expected

    with_ledger_db(tmp_path, body)


def test_min_interval_caps_transactions_but_a_quiet_ledger_writes_at_once(tmp_path):
    async def body(store):
        t = await store.create_tenant("acme")
        quotas = QuotaManager(store)
        starts = []
        real = quotas.settle_many

        async def timed(items):
            starts.append(asyncio.get_running_loop().time())
            return await real(items)

        quotas.settle_many = timed
        ledger = UsageLedger(quotas, min_interval_s=0.05)
        ledger.start()
        g = await quotas.try_acquire(t.id, tokens=10)
        submitted = asyncio.get_running_loop().time()
        ledger.submit(g, UsageRecord(t.id, "first", "m", 1, 1))
        while not ledger.settled:
            await asyncio.sleep(0.001)
        assert starts[0] - submitted < 0.05  # no timer in the way of the first write
        for i in range(100):  # 0.3 s of steady settles
            ledger.submit(await quotas.try_acquire(t.id, tokens=10), UsageRecord(t.id, f"r{i}", "m", 1, 1))
            await asyncio.sleep(0.003)
        closing = asyncio.get_running_loop().time()
        await ledger.close()
        assert ledger.settled == 101
        # Closing writes what is left at once (shutdown does not wait out the interval): pacing is
        # checked between the writes that started before it.
        paced = [s for s in starts if s < closing]
        gaps = [b - a for a, b in zip(paced, paced[1:])]
        assert len(gaps) >= 4 and min(gaps) >= 0.049, gaps
        assert (await store.usage_summary("acme", by="tenant"))[0]["requests"] == 101

    with_ledger_db(tmp_path, body)
