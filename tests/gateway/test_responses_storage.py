"""Stored Responses API conversations through the official `openai` client against an in-process server: a
chain of `previous_response_id` steps stores each step once (the database grows linearly, not quadratically),
a tenant past its stored-response cap gets a 400 naming `store` (and can go on with store: false or after
deleting), and another tenant's stream keeps its pace while a long stored history is read back."""

import asyncio
import json
import random
import time

import httpx
import openai
import pytest
from sqlalchemy import create_engine, pool, text

from gateway.responses.routes import RESPONSE_STORE
from gateway.app_keys import CONFIG
from gateway.responses.prepare import stored_bound
from tenants.response_store import ResponseStore
from tenants.db import sync_url
from tenants.store import TenantStore
from tests.gateway.in_process import in_process_server
from tests.gateway.tenant_keys import new_tenant_key

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with in_process_server(tmp_path_factory.mktemp("responses_storage"), dict(
            num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512),
            gateway=dict(max_request_bytes=8 * 2**20, policy_cache_ttl_s=0.2)) as srv:
        keys = {name: srv.run(new_tenant_key(srv.database_url, name)) for name in ("a", "b", "c")}
        yield srv, keys


def _stored_chars(db_url: str, tenant: str) -> int:
    """Characters in every text column of the tenant's stored responses (whatever the table's layout)."""
    engine = create_engine(sync_url(db_url), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT r.* FROM responses r JOIN tenants t ON t.id = r.tenant_id "
                                     "WHERE t.name = :n"), {"n": tenant}).all()
    finally:
        engine.dispose()
    return sum(len(v) for row in rows for v in row if isinstance(v, str))


def _client(srv, key):
    return openai.AsyncOpenAI(base_url=srv.base_url, api_key=key, max_retries=0, timeout=120)


def test_chain_storage_is_linear_and_capped_per_tenant(served):
    srv, keys = served
    steps, size = 6, random.randint(20_000, 30_000)

    async def chain(client):
        previous, sizes = None, []
        for i in range(steps):
            # A reasoning item with text (stored, not rendered) makes each step's own input large.
            r = await client.responses.create(
                model="demo", previous_response_id=previous, max_output_tokens=2, temperature=0,
                input=[{"type": "reasoning", "summary": [{"type": "summary_text", "text": f"{i}" + "y" * size}],
                        # another server's encrypted reasoning: taken, not stored
                        "encrypted_content": "e" * (4 * size if i == 0 else 0) or None},
                       {"role": "user", "content": f"step {i}"}])
            previous = r.id
            sizes.append(_stored_chars(srv.database_url, "a"))
        return previous, sizes

    client = _client(srv, keys["a"])
    last, sizes = srv.run(chain(client))
    # Each step adds about its own input: the whole history again each step would be ~size * steps**2 / 2.
    assert sizes[-1] < 1.5 * steps * size and sizes[0] < 1.5 * size, sizes
    assert all(0.8 * size < b - a < 1.5 * size for a, b in zip(sizes, sizes[1:])), sizes

    async def capped():
        store = TenantStore.open(srv.database_url)
        try:
            await store.set_quota("a", stored_response_bytes=sizes[-1] + size // 2)
        finally:
            await store.close()
        await asyncio.sleep(0.5)  # the gateway's policy cache (0.2 s here) takes the new limit
        body = {"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "z" * size}]},
                          {"role": "user", "content": "more"}], "max_output_tokens": 2, "previous_response_id": last}
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model="demo", **body)
        unstored = await client.responses.create(model="demo", store=False, **body)
        first = (await client.responses.input_items.list(last, order="asc", limit=1)).data[0]
        await client.responses.delete(last)  # room again
        again = await client.responses.create(model="demo", input="short", max_output_tokens=2)
        return refused.value, unstored, first, again

    refused, unstored, first, again = srv.run(capped())
    assert refused.status_code == 400 and refused.body["param"] == "store", refused.body
    assert refused.body["code"] == "stored_responses_limit_exceeded" and "store: false" in refused.body["message"]
    assert unstored.status == "incomplete" and again.store is True
    assert first.type == "reasoning" and first.encrypted_content is None
    srv.run(client.close())


def test_other_tenants_stream_keeps_pace_while_a_long_history_is_read(served):
    """Tenant b streams while tenant c continues a conversation of ~45k stored items (reasoning items: stored,
    not rendered, so the prompt stays short): b's largest gap between chunks stays small. With the history
    read, converted and written on the event loop, b's stream stalled for the whole of it. (c's bodies are
    encoded before the clock starts: the client shares the server's event loop.)"""
    srv, keys = served
    per_step = 15_000
    items = [{"type": "reasoning", "summary": []}] * per_step

    def body(step: int, previous: str | None) -> bytes:
        return json.dumps({"model": "demo", "previous_response_id": previous, "max_output_tokens": 1,
                           "input": [*items, {"role": "user", "content": f"step {step}"}]}).encode()

    async def post(http: httpx.AsyncClient, content: bytes) -> dict:
        reply = await http.post("/responses", content=content, headers={"Content-Type": "application/json"})
        assert reply.status_code == 200, reply.text[:500]
        return reply.json()

    def tenant(name):
        return httpx.AsyncClient(base_url=srv.base_url, timeout=120, headers={"Authorization": f"Bearer {keys[name]}"})

    async def build():
        previous = None
        async with tenant("c") as http:
            for i in range(2):
                previous = (await post(http, body(i, previous)))["id"]
        return previous

    heavy_body = body(2, srv.run(build()))

    async def measure(heavy: bool) -> float:
        """b's largest gap between stream chunks while c's request (if ``heavy``) runs."""
        arrivals = []
        async with tenant("b") as http, tenant("c") as c:
            async def stream():
                async with http.stream("POST", "/chat/completions", json={
                        "model": "demo", "messages": [{"role": "user", "content": "count"}], "max_tokens": 200,
                        "ignore_eos": True, "temperature": 0, "stream": True}) as reply:
                    async for line in reply.aiter_lines():
                        if line.startswith("data: "):
                            arrivals.append(time.perf_counter())

            streaming = asyncio.create_task(stream())
            while len(arrivals) < 5:
                await asyncio.sleep(0.01)
            start = time.perf_counter()
            if heavy:
                assert (await post(c, heavy_body))["status"] in ("completed", "incomplete")
            else:
                await asyncio.sleep(0.5)
            end = time.perf_counter()
            await streaming
        assert arrivals[-1] > end, "b's stream ended before c's request did: make it longer"
        return max(b - a for a, b in zip(arrivals, arrivals[1:]) if b >= start and a <= end)

    quiet = srv.run(measure(False))
    busy = srv.run(measure(True))
    print(f"b's largest gap: {quiet:.3f} s alone, {busy:.3f} s beside c's long history")
    # Measured on a loaded 2-core machine: 0.26-0.33 s here against 0.68 s with the history handled on the loop
    # (b alone: 0.03-0.12 s).
    assert busy < max(0.45, 4 * quiet), (quiet, busy)


def test_a_stored_chain_never_grows_past_what_is_read_back(served):
    """A conversation is read back up to the store's depth: continuing one that deep with store on is a 400 naming
    previous_response_id (stored, the new step's own input_items would be refused), with store: false it goes on."""
    srv, _ = served
    store = srv.server.app[RESPONSE_STORE]
    depth, kept = random.randint(2, 4), store.max_depth
    key = srv.run(new_tenant_key(srv.database_url, "deep"))

    async def go():
        async with _client(srv, key) as client:
            previous = None
            for _ in range(depth):
                r = await client.responses.create(model="demo", previous_response_id=previous, input="hi",
                                                  max_output_tokens=2, temperature=0)
                previous = r.id
                assert len((await client.responses.input_items.list(previous)).data) >= 1
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(model="demo", previous_response_id=previous, input="hi",
                                              max_output_tokens=2)
            assert refused.value.param == "previous_response_id"
            r = await client.responses.create(model="demo", previous_response_id=previous, input="hi",
                                              max_output_tokens=2, store=False)
            assert r.status in ("completed", "incomplete")

    store.max_depth = depth
    try:
        srv.run(go())
    finally:
        store.max_depth = kept


def test_a_refused_tenant_costs_no_read_of_its_stored_conversation(served, monkeypatch):
    """A tenant past its rate limit is refused (429) before its previous_response_id chain is read or decoded."""
    srv, _ = served
    key = srv.run(new_tenant_key(srv.database_url, "refused-early"))
    client = _client(srv, key)
    first = srv.run(client.responses.create(model="demo", input="hello", max_output_tokens=2))
    reads = []
    chain_rows = ResponseStore.chain_rows

    async def counted(self, tenant_id, response_id):
        reads.append(response_id)
        return await chain_rows(self, tenant_id, response_id)

    monkeypatch.setattr(ResponseStore, "chain_rows", counted)

    async def refused():
        store = TenantStore.open(srv.database_url)
        try:
            await store.set_quota("refused-early", requests_per_minute=0)
        finally:
            await store.close()
        await asyncio.sleep(0.5)  # the gateway's policy cache (0.2 s here) takes the new limit
        with pytest.raises(openai.RateLimitError) as e:
            await client.responses.create(model="demo", input="more", max_output_tokens=2,
                                          previous_response_id=first.id)
        return e.value

    error = srv.run(refused())
    assert error.status_code == 429 and error.body["code"] == "rate_limit_exceeded", error.body
    assert reads == [], f"the stored conversation was read for a refused request: {reads}"
    srv.run(client.close())


def test_the_cap_counts_the_responses_own_output(served, monkeypatch):
    """A response whose output may not fit the tenant's stored-response room is refused before it runs (400 naming
    store); one that passed that check but is past the cap once its real output is known (here: the check is made
    to see an empty store) is answered with store: false and not stored. Either way the tenant never holds more
    than its cap."""
    srv, _ = served
    rng = random.Random()
    key = srv.run(new_tenant_key(srv.database_url, "own-output"))
    client = _client(srv, key)
    max_out = rng.randrange(20, 40)
    body = {"input": "x" * rng.randrange(50, 200), "max_output_tokens": max_out, "temperature": 0}
    size = len(json.dumps({"model": "demo", **body}))
    stored = lambda: _stored_bytes(srv.database_url, "own-output")  # noqa: E731

    async def set_cap(cap):
        store = TenantStore.open(srv.database_url)
        try:
            await store.set_quota("own-output", stored_response_bytes=cap)
        finally:
            await store.close()
        await asyncio.sleep(0.5)  # the gateway's policy cache (0.2 s here) takes the new limit

    # Room for the body, not for its output: refused before it runs (it ran, and was stored past the cap, before).
    srv.run(set_cap(size + 64))
    with pytest.raises(openai.BadRequestError) as refused:
        srv.run(client.responses.create(model="demo", **body))
    assert refused.value.body["code"] == "stored_responses_limit_exceeded" and refused.value.body["param"] == "store"
    assert stored() == 0

    # A response stored first takes more than the cap set next, which still leaves room for the request's bound;
    # the room check made to see nothing stored passes it, and the store's own check, with the real size, refuses.
    bound = stored_bound(size, max_out, srv.server.app[CONFIG].default_reservation_tokens)
    srv.run(set_cap(None))
    filler = [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "y" * (bound + 100)}]},
              {"role": "user", "content": "hi"}]  # a reasoning item's text: stored, not rendered
    free = srv.run(client.responses.create(model="demo", input=filler, max_output_tokens=2))
    before = stored()
    assert before > bound + 16
    srv.run(set_cap(bound + 16))
    monkeypatch.setattr(ResponseStore, "stored_bytes", lambda self, tenant_id: _zero())
    made = srv.run(client.responses.create(model="demo", **body))
    assert made.store is False and made.output_text is not None
    assert stored() == before
    with pytest.raises(openai.NotFoundError):
        srv.run(client.responses.retrieve(made.id))
    streamed = srv.run(_stream_final(client, body))
    assert streamed["store"] is False and stored() == before
    assert srv.run(client.responses.retrieve(free.id)).id == free.id  # what was stored stays
    srv.run(client.close())


async def _zero() -> int:
    return 0


async def _stream_final(client, body) -> dict:
    final = None
    async with await client.responses.create(model="demo", stream=True, **body) as stream:
        async for event in stream:
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response.model_dump()
    return final


def _stored_bytes(db_url: str, tenant: str) -> int:
    """The stored_bytes of the tenant's stored responses, summed (as the cap counts them)."""
    engine = create_engine(sync_url(db_url), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            return int(conn.execute(text("SELECT COALESCE(SUM(r.stored_bytes), 0) FROM responses r JOIN tenants t "
                                         "ON t.id = r.tenant_id WHERE t.name = :n"), {"n": tenant}).scalar())
    finally:
        engine.dispose()
