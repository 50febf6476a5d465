"""Stored Responses API responses on SQLite and PostgreSQL: found only by their own tenant and only until they
expire; deleted once, purged once expired."""

import random
from datetime import timedelta

import pytest

from tenants.models import utcnow
from tenants.response_store import ResponseStore

from .helpers import with_store


def test_per_tenant_expiry_delete_and_purge(db_url):
    async def body(store):
        a, b = await store.create_tenant("a"), await store.create_tenant("b")
        kept = ResponseStore(store, retention_s=3600)
        conversation = [{"role": "user", "content": "hi " * random.randint(1, 9)},
                        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}]
        response = {"id": f"resp_{random.getrandbits(64):x}", "object": "response", "output": [], "n": 1.5}
        saved = await kept.put(a.id, response, conversation)
        assert saved.expires_at - saved.created_at == timedelta(hours=1)
        got = await kept.get(a.id, response["id"])
        assert (got.response, got.conversation) == (response, conversation)
        assert await kept.get(b.id, response["id"]) is None  # another tenant's
        assert await kept.delete(b.id, response["id"]) is False and await kept.get(a.id, response["id"])
        assert await kept.delete(a.id, response["id"]) is True and await kept.get(a.id, response["id"]) is None
        assert await kept.delete(a.id, response["id"]) is False

        brief = ResponseStore(store, retention_s=0.001)  # expired as soon as it is stored
        await brief.put(a.id, {**response, "id": "resp_old"}, conversation)
        await kept.put(a.id, {**response, "id": "resp_new"}, conversation)
        await kept.put(b.id, {**response, "id": "resp_b"}, conversation)
        assert await brief.get(a.id, "resp_old") is None  # past its expiry, even before the purge
        assert await kept.purge_expired() == 1
        assert await kept.purge_expired(now=utcnow() + timedelta(hours=2)) == 2
        with pytest.raises(ValueError):
            ResponseStore(store, retention_s=0)

    with_store(db_url, body)
