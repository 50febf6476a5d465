"""One request cannot hurt another: a chat template that raises, a huge prompt, a failed engine step,
and the engine's restart, against a real server and engine process on loopback."""

import asyncio
import io
import json
import logging
import os
import random
import time

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer

from engine.serving.async_engine import AsyncEngine
from engine.core.config import EngineConfig
from engine.loading.demo_model import write_demo_model
from gateway.app import create_app
from gateway.config import GatewayConfig
from tenants.migrate import upgrade
from tenants.store import TenantStore
from tests.gateway.failing_step import POISON_TAIL, POISON_TOKEN, run_with_failing_detokenizer, run_with_failing_step

# A template in the style of Mixtral's: turns must alternate user/assistant, or it raises.
ALTERNATING_TEMPLATE = (
    "{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }}\n"
    "{% endfor %}assistant:"
)
NOT_ALTERNATING = [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]


@pytest.fixture(scope="module")
def strict_template_dir(tmp_path_factory):
    """The demo model, with a chat template that raises on turns that do not alternate."""
    path = str(tmp_path_factory.mktemp("strict"))
    write_demo_model(path, seed=random.randrange(1000))
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(ALTERNATING_TEMPLATE)
    return path


async def _keys(url: str, names=("a", "b")) -> dict[str, str]:
    store = TenantStore.open(url)
    try:
        keys = {}
        for name in names:
            await store.create_tenant(name)
            keys[name] = (await store.create_key(name))[1]
        return keys
    finally:
        await store.close()


def _setup(model_dir: str, tmp_path, **engine_kw):
    url = f"sqlite:///{tmp_path / 'policy.db'}"
    upgrade(url)
    engine = AsyncEngine(EngineConfig(model=model_dir, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=128),
                         **engine_kw)
    app = create_app(GatewayConfig(served_model_name="demo", database_url=url, data_dir=str(tmp_path / "data")), engine)
    return url, engine, TestServer(app, host="127.0.0.1")


def _client(server, key) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key=key, max_retries=0)


async def _stream_gaps(client: openai.AsyncOpenAI, max_tokens: int) -> tuple[int, float]:
    """Stream a completion; (tokens received, the longest wait between two chunks in seconds)."""
    stream = await client.completions.create(model="demo", prompt="A long story:", max_tokens=max_tokens,
                                             temperature=0, stream=True, extra_body={"ignore_eos": True},
                                             stream_options={"include_usage": True})
    last, gap, tokens = time.monotonic(), 0.0, 0
    async for chunk in stream:
        now = time.monotonic()
        gap, last = max(gap, now - last), now
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens, gap


@pytest.mark.timeout(240)
def test_a_template_that_raises_fails_that_request_alone(strict_template_dir, tmp_path):
    url, engine, server = _setup(strict_template_dir, tmp_path)

    async def scenario():
        keys = await _keys(url)
        async with server:
            a, b = _client(server, keys["a"]), _client(server, keys["b"])
            pid = engine._process.pid
            other = asyncio.create_task(_stream_gaps(b, 64))  # tenant b streams throughout
            await asyncio.sleep(0.3)
            with pytest.raises(openai.BadRequestError) as refused:
                await a.chat.completions.create(model="demo", messages=NOT_ALTERNATING, max_tokens=4)
            body = refused.value.body
            assert body["param"] == "messages" and "alternate" in body["message"]
            assert (await other)[0] == 64  # tenant b's stream finished whole
            assert engine._process.pid == pid and engine._process.is_alive() and not engine.dead
            ok = await a.chat.completions.create(model="demo", max_tokens=4, temperature=0,
                                                 messages=[{"role": "user", "content": "hi"}])
            assert ok.choices[0].finish_reason in ("length", "stop")

            # The same conversation as a Batch API line: that line fails once, with its error in the error
            # file; the other line is answered; the engine is never restarted.
            lines = [{"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": "demo", "max_tokens": 4, "messages": NOT_ALTERNATING}},
                     {"custom_id": "good", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}}]
            data = ("\n".join(json.dumps(line) for line in lines) + "\n").encode()
            f = await a.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
            batch = await a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
            deadline = time.monotonic() + 60
            while batch.status not in ("completed", "failed", "cancelled", "expired"):
                assert time.monotonic() < deadline, f"batch still {batch.status}"
                await asyncio.sleep(0.2)
                batch = await a.batches.retrieve(batch.id)
            assert batch.status == "completed"
            assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 1)
            errors = [json.loads(line) for line in (await a.files.content(batch.error_file_id)).text.splitlines()]
            assert [e["custom_id"] for e in errors] == ["bad"]
            assert errors[0]["response"]["status_code"] == 400
            assert "alternate" in errors[0]["response"]["body"]["error"]["message"]
            assert engine._process.pid == pid

    asyncio.run(scenario())


@pytest.mark.timeout(240)
def test_a_huge_prompt_is_refused_without_stalling_other_streams(strict_template_dir, tmp_path):
    url, engine, server = _setup(strict_template_dir, tmp_path)

    async def scenario():
        keys = await _keys(url)
        async with server:
            a, b = _client(server, keys["a"]), _client(server, keys["b"])
            await _stream_gaps(b, 8)  # warm
            _, quiet_gap = await _stream_gaps(b, 48)
            other = asyncio.create_task(_stream_gaps(b, 48))
            await asyncio.sleep(0.2)
            huge = "lorem ipsum dolor sit amet " * 150_000  # ~4 MB
            for kind in ("prompt", "messages"):
                t0 = time.monotonic()
                with pytest.raises(openai.BadRequestError) as refused:
                    if kind == "prompt":
                        await a.completions.create(model="demo", prompt=huge, max_tokens=4)
                    else:
                        await a.chat.completions.create(model="demo", max_tokens=4,
                                                        messages=[{"role": "user", "content": huge}])
                # Refused by its size: the ~1.5 s it takes to send and parse the body, not the seconds
                # tokenizing 4 MB takes.
                assert time.monotonic() - t0 < 3.0
                assert refused.value.body["param"] == kind and "context" in refused.value.body["message"]
            # Just under the size bound: tokenized (on a worker thread), then refused by its token count.
            long_text = "x y " * (engine.inputs.max_prompt_chars // 4 - 1)
            with pytest.raises(openai.BadRequestError) as refused:
                await a.completions.create(model="demo", prompt=long_text, max_tokens=4)
            assert "tokens" in refused.value.body["message"]
            tokens, gap = await other
            assert tokens == 48
            assert gap < max(1.0, 5 * quiet_gap), (gap, quiet_gap)

    asyncio.run(scenario())


@pytest.mark.timeout(240)
def test_a_failed_step_fails_its_requests_without_retry_and_the_engine_comes_back(strict_template_dir, tmp_path,
                                                                                  caplog):
    """The client is told the engine failed while running its request, not what the engine reported (other
    tenants' requests in the step get the same answer); the operator's log has the exception."""
    url, engine, server = _setup(strict_template_dir, tmp_path, process_main=run_with_failing_step)

    async def scenario():
        keys = await _keys(url)
        async with server:
            # Default retries on: the SDK must not send the failed request again (x-should-retry: false).
            a = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key=keys["a"], max_retries=2)
            pid = engine._process.pid
            # Tenant b's stream is running when a's request fails the step: its error event says so too.
            b = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key=keys["b"], max_retries=0)
            stream = await b.completions.create(model="demo", prompt=[1, 2, 3], max_tokens=2000, stream=True,
                                                extra_body={"ignore_eos": True})
            await anext(aiter(stream))
            with pytest.raises(openai.InternalServerError) as failed:
                await a.completions.create(model="demo", prompt=[POISON_TOKEN, 1, 2], max_tokens=4)
            with pytest.raises(openai.APIError) as cut:
                async for _ in stream:
                    pass
            assert cut.value.body["code"] == "engine_failed", cut.value.body  # not a retryable engine_unavailable
            assert "device-side" not in cut.value.message
            assert failed.value.status_code == 503
            assert failed.value.response.headers.get("x-should-retry") == "false"
            message = failed.value.body["message"]
            assert failed.value.body["code"] == "engine_failed" and "failed while running this request" in message
            assert "device-side" not in message and "RuntimeError" not in message, message
            async with aiohttp.ClientSession() as http:
                deadline = time.monotonic() + 60
                while True:
                    async with http.get(server.make_url("/health")) as r:
                        if r.status == 200:
                            break
                    assert time.monotonic() < deadline, "the engine did not come back"
                    await asyncio.sleep(0.1)
            assert engine._process.pid != pid
            ok = await a.completions.create(model="demo", prompt=[1, 2, 3], max_tokens=4)
            assert ok.usage.completion_tokens >= 1

    with caplog.at_level(logging.ERROR, logger="gateway.engine_supervisor"):
        asyncio.run(scenario())
    assert any("RuntimeError: device-side assert" in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.timeout(240)
def test_health_says_ready_only_once_the_restarted_engine_is(strict_template_dir, tmp_path):
    url, engine, server = _setup(strict_template_dir, tmp_path)

    async def scenario():
        keys = await _keys(url, ("a",))
        async with server, aiohttp.ClientSession() as http:
            a = _client(server, keys["a"])
            old_info, old_process = engine.info, engine._process
            old_process.kill()
            seen = []
            deadline = time.monotonic() + 60
            while True:
                async with http.get(server.make_url("/health")) as r:
                    seen.append(r.status)
                    # Until the gateway has seen the process die (503), the old state still stands.
                    if r.status == 200 and 503 in seen:
                        # Ready means a new engine process said so (not the old one's state, kept over)
                        assert engine.info is not None and engine.info is not old_info
                        assert engine._process is not old_process and engine._process.is_alive()
                        break
                assert time.monotonic() < deadline, "the engine did not come back"
                await asyncio.sleep(0.02)
            assert 503 in seen
            ok = await a.completions.create(model="demo", prompt="hi", max_tokens=2)
            assert ok.usage.completion_tokens >= 1

    asyncio.run(scenario())


@pytest.mark.timeout(240)
def test_engine_killed_mid_load_loses_nothing(strict_template_dir, tmp_path):
    """kill -9 of the engine process while 12 clients keep sending: every answer is a 200 or a 503 in the
    OpenAI shape (no 500, no hang), each answered request is billed once, the restarted engine serves
    with every KV block free."""
    url, engine, server = _setup(strict_template_dir, tmp_path)

    async def scenario():
        keys = await _keys(url, ("a",))
        statuses: list[int] = []
        async with server:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {keys['a']}"},
                                             timeout=aiohttp.ClientTimeout(total=60)) as http:
                stop = asyncio.Event()

                async def client():
                    while not stop.is_set():
                        body = {"model": "demo", "prompt": "tell me", "max_tokens": random.randint(2, 24)}
                        async with http.post(server.make_url("/v1/completions"), json=body) as r:
                            answer = await r.json()
                            statuses.append(r.status)
                            if r.status != 200:
                                assert r.status == 503 and answer["error"]["code"] == "engine_unavailable", answer
                                await asyncio.sleep(0.2)

                async def killer():
                    # Kill once the load is well under way (already more than the 20 answers asserted below) ...
                    deadline = time.monotonic() + 60
                    while statuses.count(200) < 40:
                        assert time.monotonic() < deadline, f"only {statuses.count(200)} answers under load"
                        await asyncio.sleep(0.02)
                    engine._process.kill()
                    since_kill = len(statuses)
                    # ... and keep every client sending through the outage until the restarted engine has answered
                    # a round of them (200s after the first 503), rather than for a fixed time.
                    while 503 not in (after := statuses[since_kill:]) or after[after.index(503):].count(200) < 12:
                        assert time.monotonic() < deadline + 60, "the engine did not come back under load"
                        await asyncio.sleep(0.05)
                    stop.set()

                await asyncio.gather(*(client() for _ in range(12)), killer())
                deadline = time.monotonic() + 60
                while engine.dead or engine.info is None:
                    assert time.monotonic() < deadline, "the engine did not come back"
                    await asyncio.sleep(0.1)
                async with http.post(server.make_url("/v1/completions"),
                                     json={"model": "demo", "prompt": "after", "max_tokens": 2}) as r:
                    assert r.status == 200
                    statuses.append(200)
            for _ in range(100):
                if engine.stats is not None and engine.stats.kv_blocks_used == 0:
                    break
                await asyncio.sleep(0.1)
            assert engine.stats.kv_blocks_used == 0 and engine.stats.num_running == 0
        assert statuses.count(503) > 0 and statuses.count(200) > 20
        assert statuses.count(200) + statuses.count(503) == len(statuses)
        import sqlite3

        with sqlite3.connect(tmp_path / "policy.db") as db:
            rows = db.execute("SELECT request_id, http_status FROM usage").fetchall()
        assert len({r for r, _ in rows}) == len(rows)  # billed once each
        assert sum(1 for _, s in rows if s == 200) == statuses.count(200)  # every answered request billed
        assert all(s in (200, 503) for _, s in rows)  # cut by the crash: billed for what they produced

    asyncio.run(scenario())


@pytest.mark.timeout(240)
def test_logs_at_the_default_level_hold_no_key_and_no_prompt(strict_template_dir, tmp_path, caplog):
    url, engine, server = _setup(strict_template_dir, tmp_path)
    secret_text = "zebra-" + "".join(random.choices("qwxyz", k=24))

    async def scenario():
        keys = await _keys(url, ("a",))
        async with server:
            a = _client(server, keys["a"])
            await a.completions.create(model="demo", prompt=secret_text, max_tokens=2)
            await a.chat.completions.create(model="demo", max_tokens=2, messages=[{"role": "user", "content": secret_text}])
            for bad in (lambda: a.chat.completions.create(model="demo", max_tokens=2, messages=[
                            {"role": "user", "content": secret_text}, {"role": "user", "content": secret_text}]),
                        lambda: a.completions.create(model="demo", prompt=secret_text * 20_000, max_tokens=2),
                        lambda: a.completions.create(model="demo", prompt=secret_text, max_tokens=2, temperature=9)):
                with pytest.raises(openai.BadRequestError):
                    await bad()
        return keys["a"]

    with caplog.at_level(logging.INFO):
        key = asyncio.run(scenario())
    logged = "\n".join(r.getMessage() + (logging.Formatter().formatException(r.exc_info) if r.exc_info else "")
                       for r in caplog.records)
    assert "serving demo" in logged  # the gateway's log was captured
    assert secret_text not in logged and key not in logged


@pytest.mark.timeout(240)
def test_a_request_whose_text_fails_ends_alone(strict_template_dir, tmp_path):
    """A detokenizer failure ends that request (500 request_failed, not retried) and no other: the engine
    process is the same and a concurrent stream of another tenant completes."""
    url, engine, server = _setup(strict_template_dir, tmp_path, process_main=run_with_failing_detokenizer)

    async def scenario():
        keys = await _keys(url)
        async with server:
            a = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key=keys["a"], max_retries=2)
            b = _client(server, keys["b"])
            pid = engine._process.pid
            other = asyncio.create_task(_stream_gaps(b, 48))
            await asyncio.sleep(0.3)
            with pytest.raises(openai.InternalServerError) as failed:
                await a.completions.create(model="demo", prompt=[1, 2] + POISON_TAIL, max_tokens=8)
            assert failed.value.body["code"] == "request_failed"
            assert failed.value.response.headers.get("x-should-retry") == "false"
            # Streamed: the error arrives as an event in the OpenAI shape, which the SDK raises.
            stream = await a.completions.create(model="demo", prompt=[3] + POISON_TAIL, max_tokens=8, stream=True)
            with pytest.raises(openai.APIError) as failed:
                async for _ in stream:
                    pass
            assert "could not produce" in str(failed.value)
            assert (await other)[0] == 48
            assert engine._process.pid == pid and not engine.dead

    asyncio.run(scenario())
