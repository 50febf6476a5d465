from datetime import datetime, timezone

import pytest

from tenants.ttl_cache import RefreshingCache
from tenants.quota import Denied, Granted, QuotaManager
from tenants.store import NotFound, UsageRecord

from .helpers import with_store

NOW = datetime(2025, 3, 15, 10, 0, 30, tzinfo=timezone.utc).timestamp()  # 30 s into a minute


class Clock:
    def __init__(self, t: float = NOW) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def usage(tenant_id, prompt, completion, rid="r"):
    return UsageRecord(tenant_id, rid, "m", prompt, completion)


def test_rpm_fixed_window(db_url):
    async def body(store):
        t = await store.create_tenant("acme")
        await store.set_quota("acme", requests_per_minute=2)
        clock = Clock()
        qm = QuotaManager(store, clock)
        assert isinstance(await qm.try_acquire(t.id), Granted)
        assert isinstance(await qm.try_acquire(t.id), Granted)
        d = await qm.try_acquire(t.id)
        assert isinstance(d, Denied) and d.reason == "rpm"
        assert (d.limit, d.remaining, d.reset_s, d.retry_after_s) == (2, 0, 30.0, 30.0)
        clock.t += 30  # the next minute
        assert isinstance(await qm.try_acquire(t.id), Granted)

    with_store(db_url, body)


def test_reserve_then_settle_gives_back_unused_tokens(db_url):
    async def body(store):
        t = await store.create_tenant("acme")
        await store.set_quota("acme", tokens_per_minute=100, daily_tokens=1000, monthly_tokens=5000)
        qm = QuotaManager(store, Clock())
        g = await qm.try_acquire(t.id, tokens=80)
        assert isinstance(g, Granted)
        d = await qm.try_acquire(t.id, tokens=30)
        assert isinstance(d, Denied) and d.reason == "tpm" and d.remaining == 20
        assert await qm.settle(g, usage(t.id, 10, 15)) == 25
        assert await qm.counter(t.id, "tpm", g.minute) == 25
        assert await qm.counter(t.id, "day", g.day) == 25 and await qm.counter(t.id, "month", g.month) == 25
        assert await qm.counter(t.id, "conc", 0) == 0
        assert isinstance(await qm.try_acquire(t.id, tokens=30), Granted)
        rows = await store.usage_summary("acme", by="model")
        assert rows[0]["billed_tokens"] == 25 and rows[0]["requests"] == 1

    with_store(db_url, body)


def test_denial_rolls_back_earlier_counters(db_url):
    async def body(store):
        t = await store.create_tenant("acme")
        await store.set_quota("acme", requests_per_minute=10, tokens_per_minute=1000, daily_tokens=50)
        qm = QuotaManager(store, Clock())
        d = await qm.try_acquire(t.id, tokens=60)
        assert isinstance(d, Denied) and d.reason == "daily_tokens" and d.retry_after_s is None
        g = await qm.try_acquire(t.id, tokens=40)
        assert isinstance(g, Granted)
        assert await qm.counter(t.id, "rpm", g.minute) == 1  # the refused acquire left no trace
        assert await qm.counter(t.id, "tpm", g.minute) == 40
        d = await qm.try_acquire(t.id, tokens=20)
        assert d.reason == "daily_tokens" and d.remaining == 10 and d.reset_s == 14 * 3600 - 30

    with_store(db_url, body)


def test_concurrency_max_tokens_disabled_and_release(db_url):
    async def body(store):
        t = await store.create_tenant("acme")
        await store.set_quota("acme", max_concurrency=1, max_tokens_per_request=100)
        qm = QuotaManager(store, Clock())
        d = await qm.try_acquire(t.id, tokens=101)
        assert d.reason == "max_tokens" and d.retry_after_s is None
        g = await qm.try_acquire(t.id, tokens=100)
        d = await qm.try_acquire(t.id, tokens=1)
        assert d.reason == "concurrency" and d.retry_after_s == 1.0 and d.reset_s is None
        await qm.release(g)
        g = await qm.try_acquire(t.id, tokens=1)
        assert isinstance(g, Granted)
        await qm.settle(g, usage(t.id, 1, 0))
        await store.set_tenant_status("acme", False)
        assert (await qm.try_acquire(t.id)).reason == "disabled"
        with pytest.raises(NotFound):
            await qm.try_acquire(9999)

    with_store(db_url, body)


def test_batch_requests_are_billed_at_the_discount(db_url):
    async def body(store):
        t = await store.create_tenant("acme")
        await store.set_quota("acme", daily_tokens=100, batch_discount=0.25, max_batch_queue_tokens=50)
        qm = QuotaManager(store, Clock())
        g = await qm.try_acquire(t.id, tokens=200, batch=True)
        assert isinstance(g, Granted) and g.billed == 50
        assert await qm.settle(g, usage(t.id, 100, 21)) == 31  # ceil(121 * 0.25)
        assert await qm.counter(t.id, "day", g.day) == 31
        assert isinstance(await qm.reserve_batch_queue(t.id, 40), Granted)
        d = await qm.reserve_batch_queue(t.id, 20)
        assert d.reason == "batch_queue_tokens" and d.remaining == 10
        await qm.release_batch_queue(t.id, 40)
        assert isinstance(await qm.reserve_batch_queue(t.id, 50), Granted)

    with_store(db_url, body)


def test_unlimited_tenant_is_always_granted(db_url):
    async def body(store):
        t = await store.create_tenant("acme")
        qm = QuotaManager(store, Clock())
        for _ in range(5):
            g = await qm.try_acquire(t.id, tokens=10**6)
            assert isinstance(g, Granted)
            await qm.settle(g, usage(t.id, 5, 5))
        assert await store.billed_since(t.id, datetime(2000, 1, 1).date()) == 50

    with_store(db_url, body)


def test_settle_many_matches_one_by_one_settles(db_url):
    """A batch of settles and releases leaves the counters and the ledger exactly as single settles do."""
    import random

    rng = random.Random()

    async def body(store):
        a = await store.create_tenant("a")
        b = await store.create_tenant("b")
        await store.set_quota("a", tokens_per_minute=10**6, max_concurrency=100, daily_tokens=10**7)
        await store.set_quota("b", monthly_tokens=10**7, batch_discount=0.5)
        clock = Clock()
        qm = QuotaManager(store, clock)
        items = []
        for i in range(40):
            t = rng.choice([a, b])
            g = await qm.try_acquire(t.id, tokens=rng.randint(50, 100), batch=rng.random() < 0.3)
            assert isinstance(g, Granted)
            items.append((g, None if rng.random() < 0.2 else usage(t.id, rng.randint(1, 30), rng.randint(0, 20), f"r{i}")))
        mid = len(items) // 2
        billed = [await qm.settle(g, u) if u else (await qm.release(g), 0)[1] for g, u in items[:mid]]
        billed += await qm.settle_many(items[mid:])
        expected = [0 if u is None else (
            -(-(u.prompt_tokens + u.completion_tokens) // 2) if g.batch else u.prompt_tokens + u.completion_tokens)
            for g, u in items]
        assert billed == expected
        g0 = items[0][0]
        settled = [(g, u) for g, u in items if u is not None]
        for t in (a, b):
            mine = [(g, u) for g, u in settled if g.tenant_id == t.id]
            total = sum(billed[i] for i, (g, u) in enumerate(items) if u is not None and g.tenant_id == t.id)
            assert await qm.counter(t.id, "day", g0.day) == total
            assert await qm.counter(t.id, "month", g0.month) == total
            assert await qm.counter(t.id, "conc", 0) == 0
            rows = await store.usage_summary(t.name, by="tenant")  # live and batch rows
            assert sum(r["requests"] for r in rows) == len(mine)
            assert sum(r["requests"] for r in rows if r["kind"] == "batch") == sum(g.batch for g, _ in mine)
        assert await qm.counter(a.id, "tpm", g0.minute) == sum(
            u.prompt_tokens + u.completion_tokens for g, u in settled if g.tenant_id == a.id)

    with_store(db_url, body)


def test_cached_policy_admits_unlimited_tenants_without_counters(db_url):
    async def body(store):
        t = await store.create_tenant("free")
        qm = QuotaManager(store, Clock(), policy_ttl_s=0.3)
        now = [0.0]  # the policy cache's clock, moved by hand: a slow database must not age the cached policy
        qm._policy = RefreshingCache(0.3, clock=lambda: now[0])
        g = await qm.try_acquire(t.id, tokens=500)
        assert isinstance(g, Granted) and not g.concurrent and not g.day_reserved
        assert await qm.counter(t.id, "conc", 0) == 0  # nothing was written at admission
        await qm.settle(g, usage(t.id, 100, 20))
        assert await qm.counter(t.id, "day", g.day) == 120  # ... but the settle keeps budgets true
        await store.set_quota("free", daily_tokens=150)
        assert isinstance(await qm.try_acquire(t.id, tokens=100), Granted)  # the cached policy, for now
        now[0] += 0.35  # past the TTL: the limit applies, from the true counter
        d = await qm.try_acquire(t.id, tokens=100)
        assert isinstance(d, Denied) and d.reason == "daily_tokens" and d.remaining == 30

    with_store(db_url, body)


def test_acquires_and_settles_leave_no_reference_cycles(db_url):
    """A busy gateway admits and settles thousands of requests a second; any garbage they leave in
    reference cycles waits for the cyclic collector, whose pauses stall the event loop (the p99 tail
    in docs/performance.md). Counted with DEBUG_SAVEALL, which keeps everything a collection finds."""
    import gc

    async def body(store):
        t = await store.create_tenant("busy")
        await store.set_quota("busy", requests_per_minute=10**6, tokens_per_minute=10**9, max_concurrency=10**4,
                              daily_tokens=10**9, monthly_tokens=10**10)
        qm = QuotaManager(store, Clock())

        async def traffic(rounds: int) -> int:
            ops = 0
            for r in range(rounds):
                grants = [await qm.try_acquire(t.id, tokens=100) for _ in range(10)]  # 5 counter upserts each
                await qm.settle_many([(g, usage(t.id, 10, 5, f"r{r}.{i}")) for i, g in enumerate(grants)])
                ops += len(grants) + 1
            return ops

        await traffic(1)  # first use: connections, compiled statements
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            ops = await traffic(5)
            gc.collect()
            cyclic = len(gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        # Building each upsert anew left about 70 objects in cycles per counter bump (18,000 here).
        assert cyclic < ops, f"{cyclic} objects left in reference cycles by {ops} acquires and flushes"

    with_store(db_url, body)


def test_cached_admission_answers_only_what_the_cached_policy_decides(db_url):
    async def body(store):
        free = await store.create_tenant("free")
        capped = await store.create_tenant("capped")
        await store.set_quota("capped", requests_per_minute=5)
        sized = await store.create_tenant("sized")
        await store.set_quota("sized", max_tokens_per_request=100)
        qm = QuotaManager(store, Clock(), policy_ttl_s=30)
        assert qm.try_acquire_cached(free.id, tokens=10) is None  # nothing cached yet: the store must answer
        for t in (free, capped, sized):
            await qm.try_acquire(t.id, tokens=10)  # loads the policy
        g = qm.try_acquire_cached(free.id, tokens=10)
        assert isinstance(g, Granted) and (g.tokens, g.billed, g.concurrent) == (10, 10, False)
        assert (g.minute, g.day, g.month) == (1742032800, 1741996800, 1740787200)  # 10:00, 15 March, 1 March UTC
        assert qm.try_acquire_cached(capped.id, tokens=10) is None  # a counted limit: only the database decides
        d = qm.try_acquire_cached(sized.id, tokens=101)
        assert isinstance(d, Denied) and d.reason == "max_tokens" and d.limit == 100
        assert isinstance(qm.try_acquire_cached(sized.id, tokens=100), Granted)
        assert QuotaManager(store, Clock()).try_acquire_cached(free.id) is None  # no policy cache: never

    with_store(db_url, body)


def test_grants_carry_the_tenants_cache_share(db_url):
    """The share travels with every grant to the engine: on the counted path and the cached one."""
    async def body(store):
        counted = await store.create_tenant("counted")
        free = await store.create_tenant("free")
        await store.set_quota("counted", requests_per_minute=100, cache_share=0.25)
        await store.set_quota("free", cache_share=0.5)
        for ttl in (None, 5.0):
            qm = QuotaManager(store, Clock(), policy_ttl_s=ttl) if ttl else QuotaManager(store, Clock())
            assert (await qm.try_acquire(counted.id, tokens=10)).cache_share == 0.25
            assert (await qm.try_acquire(free.id, tokens=10)).cache_share == 0.5
            # Batch API lines, which take no grant, look the share up the same way (BatchRunner's cache_share).
            assert (await qm.cache_share(counted.id), await qm.cache_share(free.id)) == (0.25, 0.5)
        await store.set_quota("free", cache_share=None)
        assert (await QuotaManager(store, Clock()).try_acquire(free.id)).cache_share is None
        assert await QuotaManager(store, Clock()).cache_share(free.id) is None

    with_store(db_url, body)
