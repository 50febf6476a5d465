"""Abusive requests against a real server (in-process, the random-weight demo model): each costs its sender, not
the other tenants. Schema floods are admitted (counted, rate-limited) before their grammar is compiled, compile off
the event loop and off the engine's step, and are counted per tenant in /metrics; a schema the grammar library
crashes on is a 400 without native text; deep nesting is a 400 naming the field, never a 500; a schema with no
finite value is a 400; a stream nobody reads is ended in the engine at a bounded backlog."""

import asyncio
import json
import random
import time

import aiohttp
import pytest

from engine.core.sampling_params import SamplingParams
from engine.core.structured_output_spec import StructuredOutput
from engine.serving.async_engine import UnreadStreamError
from tests.gateway.in_process import in_process_server
from tests.gateway.loop_lag import loop_lag_while
from tests.gateway.tenant_keys import new_tenant_key

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(loop, server, engine, key of an unlimited tenant, key of a tenant limited to 1 request a minute)."""
    with in_process_server(tmp_path_factory.mktemp("abuse"), dict(
            num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=512),
            gateway=dict(metrics_token="m"), engine_options=dict(max_unread_outputs=24)) as srv:
        free = srv.run(new_tenant_key(srv.database_url, "free"))
        limited = srv.run(new_tenant_key(srv.database_url, "limited", requests_per_minute=1))
        yield srv.loop, srv.server, srv.engine, free, limited


async def _post(server, key: str, body: dict | str) -> tuple[int, dict]:
    data = body if isinstance(body, str) else json.dumps(body)
    async with aiohttp.ClientSession() as http, http.post(
            server.make_url("/v1/chat/completions"), data=data,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}) as r:
        return r.status, await r.json()


def _chat(**extra) -> dict:
    return {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


def _schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def _wide_schema(groups: int, properties: int, tag: str) -> dict:
    """``groups`` objects of ``properties`` optional integers each: optional ones cost the compiler far more per
    byte than required ones (10 x 300: about 1.2 s, within the size limit). Not one object of 3,000: the grammar
    library compiles that, then refuses the first token after `{` (more than its 2,000 items in a row), which
    ends the request as an error."""
    return {"type": "object", "properties": {f"g{j}": {"type": "object", "properties": {
        f"{tag}{j}_{i}": {"type": "integer"} for i in range(properties)}} for j in range(groups)}}


def test_schema_flood_is_admitted_first_and_counted(served):
    loop, server, engine, free, limited = served
    huge_enum = _schema_format({"enum": [f"value-{i}-{random.random()}" for i in range(20_000)]})

    async def scenario():
        answers = [await _post(server, limited, _chat(response_format=huge_enum)) for _ in range(6)]
        async with aiohttp.ClientSession() as http, http.get(server.make_url("/metrics"),
                                                             headers={"Authorization": "Bearer m"}) as r:
            metrics = await r.text()
        return answers, metrics

    answers, metrics = loop.run_until_complete(scenario())
    statuses = [status for status, _ in answers]
    # Only the first was admitted, so only it was compiled (and refused: too large); the rest wait their minute.
    assert statuses == [400] + [429] * 5, statuses
    assert answers[0][1]["error"]["param"] == "response_format"
    counted = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("moegate_rejections_total") and 'tenant="limited"' in line}
    assert sum(counted.values()) == 6, counted


def test_schema_compiles_off_the_event_loop_and_off_the_engine_step(served):
    loop, server, engine, free, limited = served
    tag = f"k{random.randrange(10**6)}_"

    async def scenario():
        # Compiled in the gateway (on its worker thread) and by the engine (beside its loop): seconds here.
        heavy = _post(server, free, _chat(response_format=_schema_format(_wide_schema(10, 300, tag)), max_tokens=2))
        started = time.perf_counter()
        heavy_task = asyncio.ensure_future(heavy)
        # Meanwhile another tenant's stream goes on at its pace; its longest gap between outputs is measured.
        gaps, last = [], None
        stream = engine.generate(list(range(5, 12)), SamplingParams(max_tokens=400, ignore_eos=True))
        async for _ in stream:
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            if heavy_task.done():
                break
        await stream.aclose()
        lag, (status, body) = await loop_lag_while(heavy_task)
        return time.perf_counter() - started, max(gaps), status, body

    took, worst_gap, status, body = loop.run_until_complete(scenario())
    assert status == 200, body
    assert took > 0.3, "the schema compiled too fast to show anything; make it wider"
    assert worst_gap < took / 3, (worst_gap, took)


def test_a_schema_the_library_crashes_on_is_a_clean_400(served):
    loop, server, engine, free, limited = served
    names = [f"p{i}" for i in range(12_000)]
    crashing = {"type": "object", "properties": {n: {"type": "string"} for n in names}}
    status, body = loop.run_until_complete(_post(server, free, _chat(response_format=_schema_format(crashing))))
    assert status == 400 and body["error"]["param"] == "response_format", body
    assert "panic" not in body["error"]["message"] and "backtrace" not in body["error"]["message"]

    async def in_engine():  # the engine, asked directly, refuses it as plainly
        spec = StructuredOutput(json_schema=json.dumps(crashing))
        stream = engine.generate([5, 6, 7], SamplingParams(max_tokens=2, structured_output=spec))
        with pytest.raises(ValueError) as refused:
            await anext(stream)
        return str(refused.value)

    message = loop.run_until_complete(in_engine())
    assert "panic" not in message and "backtrace" not in message and "/" not in message, message


@pytest.mark.parametrize("field", ["tools", "response_format"])
def test_deep_nesting_is_a_400_naming_the_field(served, field):
    loop, server, engine, free, limited = served
    # Levels of {"properties": {"a": ...}} (two JSON levels each): past the bound, short of what the decoder refuses.
    depth = random.randrange(260, 400) if field == "tools" else random.randrange(400, 460)
    # Written as text: Python's own json module cannot encode what it is about to send.
    nested = '{"type":"object","properties":{"a":' * depth + '{"type":"object"}' + "}}" * depth
    if field == "tools":
        body = json.dumps(_chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "@"}}],
                                tool_choice="required"))
        where = "tools[0].function"
    else:
        body = json.dumps(_chat(response_format=_schema_format("@")))
        where = "response_format.json_schema"
    body = body.replace('"@"', nested)
    status, answer = loop.run_until_complete(_post(server, free, body))
    assert status == 400, answer
    assert (answer["error"]["param"] or "").startswith(where), answer


def test_a_schema_with_no_finite_value_is_refused(served):
    loop, server, engine, free, limited = served
    node = random.choice(["a", "node", "tree"])
    endless = {"$defs": {node: {"type": "object", "properties": {"next": {"$ref": f"#/$defs/{node}"}},
                                "required": ["next"]}}, "$ref": f"#/$defs/{node}"}
    status, body = loop.run_until_complete(_post(server, free, _chat(response_format=_schema_format(endless))))
    assert status == 400 and body["error"]["param"] == "response_format", body
    assert "infinite" in body["error"]["message"]
    # With a way out (next may be null) it is served, and its output validates.
    endless["$defs"][node]["properties"]["next"] = {"anyOf": [{"$ref": f"#/$defs/{node}"}, {"type": "null"}]}
    status, body = loop.run_until_complete(_post(server, free, _chat(response_format=_schema_format(endless),
                                                                     max_tokens=64)))
    assert status == 200, body


def test_a_stream_nobody_reads_is_ended_in_the_engine(served):
    loop, server, engine, free, limited = served

    async def scenario():
        params = SamplingParams(max_tokens=400, ignore_eos=True, n=4, logprobs=20, seed=random.randrange(2**31))
        stream = engine.generate(list(range(5, 15)), params)
        await anext(stream)  # then nothing is read for a while
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and engine.stats.num_running + sum(engine.stats.num_waiting_by_priority.values()):
            await asyncio.sleep(0.1)
        running = engine.stats.num_running + sum(engine.stats.num_waiting_by_priority.values())
        unread = []
        with pytest.raises(UnreadStreamError):
            async for out in stream:
                unread.append(out)
        return running, unread

    running, unread = loop.run_until_complete(scenario())
    assert running == 0  # aborted in the engine, long before its 4 x 400 tokens
    assert len(unread) <= 24  # what waited for the reader: the bound, no more
    assert sum(len(o.token_ids) for o in unread) < 4 * 400


@pytest.mark.parametrize("field", ["guided_regex", "response_format", "guided_choice"])
def test_a_grammar_with_a_huge_lexeme_is_a_400_and_never_slows_the_steps(served, field):
    """Counted repetitions and long literals cost every mask in proportion to their length (``(ab){100000}`` held
    each engine step ~200 ms, and its first one seconds): refused at once, naming the field."""
    loop, server, engine, free, limited = served
    n = random.randrange(50_000, 100_000)  # a fresh grammar: nothing cached from an earlier run
    extra = {"guided_regex": {"guided_regex": f"(ab){{{n}}}"},
             "response_format": {"response_format": _schema_format({"type": "string", "pattern": f"^(ab){{{n}}}$"})},
             "guided_choice": {"guided_choice": ["no", "ab" * (n // 10)]}}[field]

    async def scenario():
        async def other_tenant():  # the longest wait between two of another request's tokens
            gaps, last = [], None
            async for _ in engine.generate(list(range(5, 12)), SamplingParams(max_tokens=60, ignore_eos=True)):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
            return max(gaps)

        other = asyncio.ensure_future(other_tenant())
        await asyncio.sleep(0.2)
        started = time.perf_counter()
        status, body = await _post(server, free, _chat(max_tokens=40, **extra))
        return status, body, time.perf_counter() - started, await other

    status, body, took, worst_gap = loop.run_until_complete(scenario())
    assert status == 400 and body["error"]["param"] == field, body
    assert "max_tokens" in body["error"]["message"], body  # says what to do instead
    assert took < 1.0 and worst_gap < 0.5, (took, worst_gap)


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_reply_full_of_logprobs_is_built_off_the_event_loop(served, route):
    """Many choices with 20 top logprobs each: building the whole reply held the gateway's event loop (every other
    tenant's stream) for about a second; it is built and encoded on a worker thread, and reads back whole."""
    loop, server, engine, free, limited = served
    n, tokens = 8, random.randrange(400, 440)  # n * 3 outputs stay under the fixture's 24 unread per request
    words = " ".join(random.choice(["sea", "lamp", "keeper", "glass", "storm"]) for _ in range(12))
    if route == "chat":
        path, body = "/v1/chat/completions", _chat(messages=[{"role": "user", "content": words}], n=n, max_tokens=tokens,
                                                   logprobs=True, top_logprobs=20, prompt_logprobs=20, ignore_eos=True,
                                                   seed=random.randrange(2**31))
    else:
        prompt, tokens = [random.randrange(5, 1000) for _ in range(120)], tokens - 120
        path, body = "/v1/completions", {"model": "demo", "prompt": prompt, "n": n, "max_tokens": tokens,
                                         "logprobs": 5, "echo": True, "prompt_logprobs": 20, "ignore_eos": True}

    async def send():
        async with aiohttp.ClientSession() as http, http.post(
                server.make_url(path), json=body, headers={"Authorization": f"Bearer {free}"}) as r:
            return r.status, await r.read()

    lag, (status, raw) = loop.run_until_complete(loop_lag_while(send()))
    assert status == 200, raw[:500]
    reply = json.loads(raw)  # the standard library's parser: the reply is one valid JSON document
    assert [c["index"] for c in reply["choices"]] == list(range(n))
    for c in reply["choices"]:
        if route == "chat":
            entries = c["logprobs"]["content"]
            assert len(entries) == tokens and all(len(e["top_logprobs"]) == 20 for e in entries)
            assert all(e["bytes"] == list(e["token"].encode("utf-8", "surrogatepass")) for e in entries)
        else:
            assert len(c["logprobs"]["tokens"]) == len(c["logprobs"]["top_logprobs"]) > tokens
            assert c["prompt_logprobs"][0] is None and all(len(p) >= 20 for p in c["prompt_logprobs"][1:])
    assert reply["usage"]["completion_tokens"] == n * tokens
    if route == "chat":  # the heavier body (each entry's bytes too): 0.3 s and more on the event loop before
        assert lag < 0.15, f"the event loop was held {lag:.2f} s"
