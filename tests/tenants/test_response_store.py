"""Stored Responses API responses on SQLite and PostgreSQL: found only by their own tenant and only until they
expire; deleted once, purged once expired; a conversation is a chain of rows, each holding its own items once."""

import random
from datetime import timedelta

import pytest

from tenants.models import utcnow
from tenants.response_store import ChainBroken, ChainTooLong, ResponseStore, conversation

from .helpers import with_store


def _response(rid: str, words: int) -> dict:
    return {"id": rid, "object": "response", "n": 1.5,
            "output": [{"type": "message", "role": "assistant", "content": "w " * words}]}


def test_per_tenant_expiry_delete_and_purge(db_url):
    async def body(store):
        a, b = await store.create_tenant("a"), await store.create_tenant("b")
        kept = ResponseStore(store, retention_s=3600)
        inputs = [{"role": "user", "content": "hi " * random.randint(1, 9)},
                  {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{"}]
        response = _response(f"resp_{random.getrandbits(64):x}", 3)
        saved = await kept.put(a.id, response, inputs)
        assert saved.expires_at - saved.created_at == timedelta(hours=1)
        got = await kept.get(a.id, response["id"])
        assert (got.response, got.inputs, got.parent_id) == (response, inputs, None)
        assert await kept.get(b.id, response["id"]) is None  # another tenant's
        assert await kept.chain(b.id, response["id"]) is None
        assert await kept.delete(b.id, response["id"]) is False and await kept.get(a.id, response["id"])
        assert await kept.delete(a.id, response["id"]) is True and await kept.get(a.id, response["id"]) is None
        assert await kept.delete(a.id, response["id"]) is False

        brief = ResponseStore(store, retention_s=0.001)  # expired as soon as it is stored
        await brief.put(a.id, {**response, "id": "resp_old"}, inputs)
        await kept.put(a.id, {**response, "id": "resp_new"}, inputs)
        await kept.put(b.id, {**response, "id": "resp_b"}, inputs)
        assert await brief.get(a.id, "resp_old") is None  # past its expiry, even before the purge
        assert await kept.purge_expired() == 1
        assert await kept.purge_expired(now=utcnow() + timedelta(hours=2)) == 2
        with pytest.raises(ValueError):
            ResponseStore(store, retention_s=0)

    with_store(db_url, body)


def test_chain_stores_each_item_once_and_reads_back_in_order(db_url):
    """n steps of a conversation: the stored bytes grow by each step's own size (linear in n: the old layout,
    every row holding the whole history, grew quadratically), and the chain reads back every item in order."""
    async def body(store):
        a, b = await store.create_tenant("a"), await store.create_tenant("b")
        kept = ResponseStore(store, retention_s=3600, max_depth=12)
        steps, parent, ids, expected, sizes = 10, None, [], [], []
        for i in range(steps):
            inputs = [{"role": "user", "content": f"step {i} " + "x" * random.randint(900, 1100)}]
            response = _response(f"resp_{i}_{random.getrandbits(32):x}", random.randint(200, 300))
            before = await kept.stored_bytes(a.id)
            await kept.put(a.id, response, inputs, parent, ids)
            sizes.append(await kept.stored_bytes(a.id) - before)
            parent = response["id"]
            ids.append(parent)
            expected += inputs + response["output"]
        assert max(sizes) < 2 * min(sizes) and sum(sizes) < steps * 2 * 1100 + steps * 2 * 300 * 2
        chain = await kept.chain(a.id, ids[-1])
        assert [c.id for c in chain] == ids and conversation(chain) == expected
        assert [c.id for c in await kept.chain(a.id, ids[3])] == ids[:4]
        assert await kept.stored_bytes(b.id) == 0 and await kept.chain(b.id, ids[-1]) is None

        # Continuing a conversation keeps its earlier responses as long as its newest.
        first = await kept.get(a.id, ids[0])
        late = ResponseStore(store, retention_s=7200)
        await late.put(a.id, _response("resp_late", 1), [], ids[-1], ids)
        assert (await kept.get(a.id, ids[0])).expires_at > first.expires_at + timedelta(minutes=50)
        assert await kept.purge_expired(now=utcnow() + timedelta(hours=1, minutes=30)) == 0

        await kept.delete(a.id, ids[4])
        with pytest.raises(ChainBroken) as broken:
            await kept.chain(a.id, ids[-1])
        assert broken.value.missing == ids[4]
        parent = None
        for i in range(14):
            await kept.put(a.id, _response(f"resp_long_{i}", 1), [], parent)
            parent = f"resp_long_{i}"
        assert len(await kept.chain(a.id, "resp_long_12")) == 13  # 12 links back from it: max_depth
        with pytest.raises(ChainTooLong):
            await kept.chain(a.id, "resp_long_13")

    with_store(db_url, body)
