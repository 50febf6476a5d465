import base64
from datetime import date, datetime, timedelta

import pytest

from tenants import keys as keylib
from tenants.store import Conflict, NotFound, QuotaConfig, StoreError, UsageRecord

from .helpers import with_store


def test_tenant_crud(db_url):
    async def body(store):
        t = await store.create_tenant("acme", "realtime", weight=2.0)
        assert (t.name, t.priority_class, t.weight, t.status) == ("acme", "realtime", 2.0, "active")
        assert (await store.create_tenant("beta")).priority_class == "standard"
        with pytest.raises(Conflict, match="already exists"):
            await store.create_tenant("acme")
        with pytest.raises(NotFound):
            await store.create_tenant("gamma", "nope")
        assert [x.name for x in await store.list_tenants()] == ["acme", "beta"]
        assert (await store.get_tenant(t.id)).name == "acme"
        u = await store.update_tenant("acme", name="acme2", priority_class="batch", weight=3.0)
        assert (u.name, u.priority_class, u.weight) == ("acme2", "batch", 3.0)
        with pytest.raises(Conflict):
            await store.update_tenant("acme2", name="beta")
        with pytest.raises(StoreError):
            await store.update_tenant("acme2", weight=-1)
        assert (await store.get_tenant("acme2")).weight == 3.0  # the refused update changed nothing
        assert (await store.set_tenant_status("acme2", False)).status == "disabled"
        assert (await store.set_tenant_status("acme2", True)).status == "active"
        with pytest.raises(NotFound, match="unknown tenant"):
            await store.get_tenant("nobody")

    with_store(db_url, body)


def test_keys_are_hashed_shown_once_and_revocable(db_url):
    async def body(store):
        await store.create_tenant("acme")
        info, plaintext = await store.create_key("acme", "ci")
        assert plaintext.startswith("mg-") and len(plaintext) >= 3 + 43
        assert info.prefix == plaintext[:8] and info.label == "ci"
        auth = await store.authenticate(plaintext)
        assert auth is not None and auth[0].name == "acme" and auth[1].id == info.id
        assert (await store.list_keys("acme"))[0].last_used_at is not None
        assert await store.authenticate(plaintext + "x") is None
        assert await store.authenticate("not-a-key") is None
        await store.set_tenant_status("acme", False)
        assert await store.authenticate(plaintext) is None
        await store.set_tenant_status("acme", True)
        revoked = await store.revoke_key(info.prefix)
        assert revoked.revoked_at is not None
        assert await store.authenticate(plaintext) is None
        with pytest.raises(NotFound):
            await store.revoke_key(999)
        assert len(await store.list_keys()) == 1 and len(await store.list_keys(include_revoked=False)) == 0

    with_store(db_url, body)

    # Only the hash is in the database.
    from sqlalchemy import create_engine, text

    from tenants.db import sync_url

    engine = create_engine(sync_url(db_url))
    with engine.connect() as conn:
        (h,) = conn.execute(text("SELECT key_hash FROM api_keys")).one()
    engine.dispose()
    assert len(h) == 64


def test_key_entropy_and_hash():
    a, b = keylib.generate_key(), keylib.generate_key()
    assert a != b and keylib.hash_key(a) != keylib.hash_key(b)
    # mg- and 32 random bytes, url-safe base64 without padding; the key looks like one, a cut one does not.
    assert a.startswith("mg-") and len(base64.urlsafe_b64decode(a[3:] + "=")) == 32
    assert keylib.looks_like_key(a) and not keylib.looks_like_key(a[:19])


def test_quota_set_and_clear(db_url):
    async def body(store):
        await store.create_tenant("acme")
        assert await store.get_quota("acme") == QuotaConfig()
        q = await store.set_quota("acme", requests_per_minute=10, tokens_per_minute=1000, batch_discount=0.25)
        assert (q.requests_per_minute, q.tokens_per_minute, q.batch_discount) == (10, 1000, 0.25)
        q = await store.set_quota("acme", tokens_per_minute=None, daily_tokens=5)
        assert (q.requests_per_minute, q.tokens_per_minute, q.daily_tokens) == (10, None, 5)
        with pytest.raises(StoreError):
            await store.set_quota("acme", requests_per_minute=-1, daily_tokens=1)
        with pytest.raises(StoreError):
            await store.set_quota("acme", batch_discount=2)
        with pytest.raises(StoreError):
            await store.set_quota("acme", bogus=1)
        with pytest.raises(NotFound):
            await store.set_quota("nobody", requests_per_minute=1)
        assert await store.get_quota("acme") == q  # refused changes wrote nothing

    with_store(db_url, body)


def test_priority_classes(db_url):
    async def body(store):
        names = [c.name for c in await store.list_classes()]
        assert names == ["realtime", "standard", "batch"]
        c = await store.create_class("premium", priority=1, default_weight=4.0, preemptible=False, may_preempt=True)
        assert c.default_weight == 4.0
        with pytest.raises(Conflict):
            await store.create_class("premium", priority=1)
        with pytest.raises(StoreError):
            await store.create_class("bad", priority=-1)
        assert (await store.create_tenant("p", "premium")).weight == 4.0
        u = await store.update_class("premium", priority=3, preemptible=True)
        assert (u.priority, u.preemptible, u.may_preempt) == (3, True, True)
        assert await store.get_class("premium") == u
        with pytest.raises(NotFound):
            await store.update_class("nope", priority=1)

    with_store(db_url, body)


def test_usage_ledger_and_summary(db_url):
    async def body(store):
        a = await store.create_tenant("acme")
        b = await store.create_tenant("beta")
        key, _ = await store.create_key("acme", "k")
        d1 = datetime(2025, 3, 1, 12)
        d2 = d1 + timedelta(days=1)
        await store.record_usage([
            UsageRecord(a.id, "r1", "m1", 100, 50, cached_prompt_tokens=20, key_id=key.id, finished_at=d1),
            UsageRecord(a.id, "r2", "m2", 10, 10, batch=True, finished_at=d2, finish_reason="stop"),
            UsageRecord(b.id, "r3", "m1", 1, 1, finished_at=d2),
        ])
        by_day = await store.usage_summary("acme", by="day")
        assert [(r["day"], r["requests"], r["billed_tokens"]) for r in by_day] == [
            ("2025-03-01", 1, 150), ("2025-03-02", 1, 10)]  # the batch request billed at 0.5
        assert by_day[0]["cached_prompt_tokens"] == 20
        by_model = await store.usage_summary(None, by="model")
        assert [(r["model"], r["requests"]) for r in by_model] == [("m1", 2), ("m2", 1)]
        by_key = await store.usage_summary("acme", by="key")
        assert {r["key"]: r["requests"] for r in by_key} == {key.prefix: 1, None: 1}
        only = await store.usage_summary(None, since=date(2025, 3, 2), until=date(2025, 3, 2), by="tenant")
        assert [(r["tenant"], r["requests"]) for r in only] == [("acme", 1), ("beta", 1)]
        assert await store.billed_since(a.id, date(2025, 3, 1)) == 160
        with pytest.raises(StoreError):
            await store.usage_summary(by="week")
        with pytest.raises(StoreError):
            await store.usage_summary(since=date(2025, 3, 2), until=date(2025, 3, 1))

    with_store(db_url, body)
