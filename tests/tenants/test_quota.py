from datetime import datetime, timezone

import pytest

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
