"""A real server on a free loopback port, driven by the official `openai` client.

Reference: the offline engine on the same demo checkpoint. Policy: tenants,
keys and quotas in a fresh SQLite database.
"""

import asyncio
import json
import os
import random
import shutil
import time

import openai
import pytest
import torch
from aiohttp.test_utils import TestServer

from engine import LLM, SamplingParams
from engine.serving.async_engine import AsyncEngine
from engine.core.config import EngineConfig
from engine.loading.demo_model import write_demo_model
from gateway.app import METRICS_URL, create_app
from gateway.config import GatewayConfig
from tenants.migrate import upgrade
from tenants.store import TenantStore
from tests.gateway.serve_process import free_port, start_server, stop_server, wait_ready
from tests.hf_models import make_hf_model


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("demo"))
    write_demo_model(path, seed=random.randrange(1000))
    return path


async def _policy(url: str) -> dict[str, str]:
    """Tenants: `web` (standard), `tight` (2 requests/min), `off` (disabled). Returns their keys."""
    store = TenantStore.open(url)
    try:
        keys = {}
        for name in ("web", "tight", "off"):
            await store.create_tenant(name)
            keys[name] = (await store.create_key(name))[1]
        await store.set_quota("tight", requests_per_minute=2)
        await store.set_tenant_status("off", False)
        return keys
    finally:
        await store.close()


def _client(server: TestServer, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key=key, max_retries=0)


def test_openai_client_end_to_end(demo_dir, tmp_path):
    url = f"sqlite:///{tmp_path / 'policy.db'}"
    upgrade(url)
    prompts = ["The quick brown fox", "Once upon a time there", "Hello"]
    offline = LLM(model=demo_dir, num_kv_blocks=128).generate(
        prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )

    async def scenario():
        keys = await _policy(url)
        engine = AsyncEngine(EngineConfig(model=demo_dir, num_kv_blocks=128, max_num_batched_tokens=64))
        app = create_app(GatewayConfig(served_model_name="demo", database_url=url, metrics_port=0,
                                       metrics_token="scrape-me"), engine)
        async with TestServer(app, host="127.0.0.1") as server:
            web = _client(server, keys["web"])
            assert [m.id for m in (await web.models.list()).data] == ["demo"]

            # Concurrent requests share engine steps; each must still equal its offline result.
            results = await asyncio.gather(*(
                web.completions.create(model="demo", prompt=p, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
                for p in prompts
            ))
            for res, ref in zip(results, offline):
                assert res.choices[0].text == ref.text and res.choices[0].finish_reason == "length"
                assert res.usage.completion_tokens == 10 and res.usage.prompt_tokens == ref.num_prompt_tokens

            stream = await web.completions.create(
                model="demo", prompt=prompts[0], max_tokens=10, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )
            chunks = [c async for c in stream]
            assert "".join(c.choices[0].text for c in chunks if c.choices) == offline[0].text
            assert len(stream.response.headers["X-Request-Id"]) == 32
            assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices

            chat = await web.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 4

            with pytest.raises(openai.AuthenticationError):
                await _client(server, "mg-not-a-real-key").models.list()
            with pytest.raises(openai.PermissionDeniedError):
                await _client(server, keys["off"]).completions.create(model="demo", prompt="x", max_tokens=2)
            with pytest.raises(openai.BadRequestError) as bad:
                await web.completions.create(model="demo", prompt="x", max_tokens=0)
            assert bad.value.body["param"] == "max_tokens"
            with pytest.raises(openai.NotFoundError):
                await web.completions.create(model="gpt-9", prompt="x", max_tokens=2)

            tight = _client(server, keys["tight"])
            # requests/min are fixed one-minute windows: keep these three requests inside one (two that
            # straddled a minute's end once saw remaining 1 twice)
            if time.time() % 60 > 55:
                await asyncio.sleep(60.2 - time.time() % 60)
            for remaining in (1, 0):
                raw = await tight.completions.with_raw_response.create(model="demo", prompt="x", max_tokens=2)
                assert raw.headers["x-ratelimit-limit-requests"] == "2"
                assert raw.headers["x-ratelimit-remaining-requests"] == str(remaining)
                assert raw.headers["x-ratelimit-reset-requests"].endswith("s")
            with pytest.raises(openai.RateLimitError) as limited:
                await tight.completions.create(model="demo", prompt="x", max_tokens=2)
            headers = limited.value.response.headers
            assert headers["x-ratelimit-limit-requests"] == "2" and headers["x-ratelimit-remaining-requests"] == "0"
            assert int(headers["Retry-After"]) >= 1

            import aiohttp

            async with aiohttp.ClientSession() as http:
                # Not on the API's listener without the metrics token (the series name tenants) ...
                async with http.get(server.make_url("/metrics"), headers={"Authorization": f"Bearer {keys['web']}"}) as resp:
                    assert resp.status == 401
                async with http.get(server.make_url("/metrics"), headers={"Authorization": "Bearer scrape-me"}) as resp:
                    assert resp.status == 200
                # ... and on its own listener.
                async with http.get(app[METRICS_URL]) as resp:
                    text = await resp.text()
                assert app[METRICS_URL].startswith("http://127.0.0.1:")
            assert 'moegate_requests_total{priority_class="standard",status="200",tenant="web"} 5.0' in text
            assert 'moegate_rejections_total{priority_class="standard",reason="rate_limit_exceeded",tenant="tight"} 1.0' in text
            assert 'moegate_completion_tokens_total{priority_class="standard",tenant="web"}' in text
            assert "moegate_time_to_first_token_seconds_count" in text and "moegate_kv_blocks_total" in text
            assert "moegate_expert_tokens_total" in text
            # every admitted web request left the engine's queue once
            assert 'moegate_queue_time_seconds_count{priority_class="standard",tenant="web"} 5.0' in text

        store = TenantStore.open(url)
        try:
            summary = await store.usage_summary("web", by="tenant")
            assert sum(r["requests"] for r in summary) == 5  # 3 + stream + chat, settled with real counts
            assert sum(r["completion_tokens"] for r in summary) == 40 + chat.usage.completion_tokens
        finally:
            await store.close()

    asyncio.run(scenario())


def test_bad_requests_get_openai_errors(demo_dir, tmp_path):
    url = f"sqlite:///{tmp_path / 'policy.db'}"
    upgrade(url)

    async def scenario():
        keys = await _policy(url)
        engine = AsyncEngine(EngineConfig(model=demo_dir, num_kv_blocks=128, max_model_len=256))
        app = create_app(GatewayConfig(served_model_name="demo", database_url=url, max_request_bytes=4096), engine)
        async with TestServer(app, host="127.0.0.1") as server:
            import aiohttp

            auth = {"Authorization": f"Bearer {keys['web']}"}
            async with aiohttp.ClientSession() as http:
                cases = [
                    ({"prompt": "x", "temperature": 5}, 400, "temperature"),
                    ({"prompt": [1, 2, 10**9]}, 400, "prompt"),
                    ({"max_tokens": 3}, 400, None),
                    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
                    ({"prompt": [random.randrange(1, 100) for _ in range(300)]}, 400, "prompt"),  # > max_model_len 256
                ]
                for body, status, param in cases:
                    async with http.post(server.make_url("/v1/completions"), json=body, headers=auth) as resp:
                        err = (await resp.json())["error"]
                        assert resp.status == status, (body, err)
                        if body.get("prompt") and len(body["prompt"]) == 300:  # says what the limit is
                            assert "255" in err["message"], err
                        assert err["message"] and err["type"]
                        if param:
                            assert err["param"] == param, (body, err)
                async with http.post(server.make_url("/v1/completions"), data=b"{not json", headers=auth) as resp:
                    assert resp.status == 400 and "JSON" in (await resp.json())["error"]["message"]
                async with http.post(server.make_url("/v1/completions"), json={"prompt": "x"}) as resp:
                    assert resp.status == 401 and resp.headers["WWW-Authenticate"] == "Bearer"
                    assert (await resp.json())["error"]["message"].startswith("missing API key")
                key = auth["Authorization"].split()[1]
                for header in (f"Basic {key}", key, "Bearer  "):  # a wrong scheme, the key alone, no key
                    async with http.post(server.make_url("/v1/completions"), json={"prompt": "x"},
                                         headers={"Authorization": header}) as resp:
                        message = (await resp.json())["error"]["message"]
                        assert resp.status == 401 and "must be 'Bearer <API key>'" in message, message
                        assert key not in message
                async with http.get(server.make_url("/health")) as resp:
                    assert resp.status == 200  # open without a key
                    assert len(resp.headers["X-Request-Id"]) == 32  # generated when the caller sends none
                async with http.post(server.make_url("/v1/completions"), json={}, headers={**auth, "X-Request-Id": "abc-123"}) as resp:
                    assert resp.status == 400 and resp.headers["X-Request-Id"] == "abc-123"  # errors carry it too
                async with http.post(server.make_url("/v1/completions"), json={"prompt": "x" * 5000}, headers=auth) as resp:
                    error = (await resp.json())["error"]
                    assert resp.status == 413 and error["code"] == "request_too_large"
                    assert "limit of 4096 bytes" in error["message"], error
                async with http.get(server.make_url("/openapi.json")) as resp:
                    spec = await resp.json()
                assert spec["openapi"].startswith("3.") and {"/v1/completions", "/v1/chat/completions", "/v1/files", "/v1/batches/{batch_id}/cancel"} <= set(spec["paths"])
                assert "prompt" in spec["components"]["schemas"]["CompletionRequest"]["required"]
                assert "429" in spec["paths"]["/v1/completions"]["post"]["responses"]
                async with http.post(server.make_url("/v1/completions"), json={"prompt": "fine", "max_tokens": 2}, headers=auth) as resp:
                    assert resp.status == 200  # still serving after the errors

    asyncio.run(scenario())


def test_cut_streams_free_their_blocks(demo_dir, tmp_path):
    """200 streams cut mid-way: every engine request is aborted and the KV pool is whole again."""
    import aiohttp

    url = f"sqlite:///{tmp_path / 'policy.db'}"
    upgrade(url)

    async def scenario():
        keys = await _policy(url)
        engine = AsyncEngine(EngineConfig(model=demo_dir, num_kv_blocks=256, max_num_seqs=32, max_num_batched_tokens=256))
        app = create_app(GatewayConfig(served_model_name="demo", database_url=url), engine)
        async with TestServer(app, host="127.0.0.1", handler_cancellation=True) as server:
            auth = {"Authorization": f"Bearer {keys['web']}"}
            body = {"prompt": "a story about a fox and a dog", "max_tokens": 400, "stream": True, "ignore_eos": True}

            async def cut_one(http):
                async with http.post(server.make_url("/v1/completions"), json=body, headers=auth) as resp:
                    assert resp.status == 200
                    await resp.content.readline()  # the first event arrived: the request is running
                # leaving the block closes the connection mid-stream

            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
                for _ in range(8):
                    await asyncio.gather(*(cut_one(http) for _ in range(25)))
            for _ in range(300):  # the engine reports its state after the aborts
                stats = engine.stats
                if stats is not None and stats.num_running == 0 and stats.kv_blocks_used == 0 and not stats.num_waiting_by_priority:
                    break
                await asyncio.sleep(0.1)
            assert stats.kv_blocks_used == 0 and stats.num_running == 0, stats
            assert stats.kv_blocks_total == 256

        store = TenantStore.open(url)
        try:
            summary = await store.usage_summary("web", by="tenant")
            assert sum(r["requests"] for r in summary) == 200  # every cut request was settled
            assert sum(r["completion_tokens"] for r in summary) < 200 * 400  # and none ran to the end
        finally:
            await store.close()
        import sqlite3

        with sqlite3.connect(tmp_path / "policy.db") as db:  # each row says the client went away
            rows = db.execute("SELECT http_status, finish_reason, COUNT(*) FROM usage GROUP BY 1, 2").fetchall()
        assert [(status, reason) for status, reason, _ in rows] == [(499, "abort")], rows

    asyncio.run(scenario())


def test_engine_crash_and_recovery(demo_dir, tmp_path):
    import json

    import aiohttp

    url = f"sqlite:///{tmp_path / 'policy.db'}"
    upgrade(url)

    async def scenario():
        keys = await _policy(url)
        engine = AsyncEngine(EngineConfig(model=demo_dir, num_kv_blocks=128))
        app = create_app(GatewayConfig(served_model_name="demo", database_url=url), engine)
        async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as http:
            auth = {"Authorization": f"Bearer {keys['web']}"}
            post = lambda body: http.post(server.make_url("/v1/completions"), json=body, headers=auth)  # noqa: E731
            async with post({"prompt": "x", "max_tokens": 3}) as resp:
                assert resp.status == 200

            long = {"prompt": "a long story", "max_tokens": 2000, "stream": True, "ignore_eos": True}
            async with post(long) as resp:
                await resp.content.readline()
                engine._process.kill()  # the engine dies mid-stream
                events = [line[6:] for line in (await resp.text()).splitlines() if line.startswith("data: ")]
            assert json.loads(events[-1])["error"]["code"] == "engine_unavailable"

            async with post({"prompt": "x", "max_tokens": 3}) as resp:
                assert resp.status == 503 and int(resp.headers["Retry-After"]) >= 1
                assert (await resp.json())["error"]["code"] == "engine_unavailable"

            health = None
            for _ in range(600):  # the supervisor restarts the engine
                async with http.get(server.make_url("/health")) as resp:
                    health = (resp.status, await resp.json())
                if health[0] == 200:
                    break
                await asyncio.sleep(0.1)
            assert health == (200, {"status": "ready", "replicas": [{"replica": "0", "status": "ready"}]})
            async with post({"prompt": "after", "max_tokens": 3}) as resp:
                assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == 3

    asyncio.run(scenario())


def test_overload_sheds_batch_and_serves_realtime(demo_dir, tmp_path):
    import aiohttp

    url = f"sqlite:///{tmp_path / 'policy.db'}"
    upgrade(url)

    async def scenario():
        store = TenantStore.open(url)
        try:
            await store.create_tenant("rt", priority_class="realtime")
            await store.create_tenant("bulk", priority_class="batch")
            rt_key, bulk_key = (await store.create_key("rt"))[1], (await store.create_key("bulk"))[1]
        finally:
            await store.close()
        engine = AsyncEngine(EngineConfig(model=demo_dir, num_kv_blocks=256, max_num_seqs=4, max_num_batched_tokens=128))
        config = GatewayConfig(served_model_name="demo", database_url=url, max_inflight_by_priority={1: 16, 2: 3})
        async with TestServer(create_app(config, engine), host="127.0.0.1") as server, aiohttp.ClientSession() as http:
            async def call(key):
                body = {"prompt": "overload", "max_tokens": 24, "ignore_eos": True}
                async with http.post(server.make_url("/v1/completions"), json=body,
                                     headers={"Authorization": f"Bearer {key}"}) as resp:
                    return resp.status, resp.headers.get("Retry-After"), await resp.json()

            results = await asyncio.gather(*([call(bulk_key) for _ in range(12)] + [call(rt_key) for _ in range(6)]))
            bulk, rt = results[:12], results[12:]
            assert all(status == 200 for status, _, _ in rt), rt  # realtime is never shed
            shed = [r for r in bulk if r[0] == 503]
            assert shed and all(r[1] and r[2]["error"]["code"] == "overloaded" for r in shed)
            assert {r[0] for r in bulk} <= {200, 503} and any(r[0] == 200 for r in bulk)

    asyncio.run(scenario())


def test_moegate_serve_answers_chat_on_a_hybrid_checkpoint(demo_dir, tmp_path):
    """`moegate serve --model DIR` (a real process) on a tiny hybrid linear-attention checkpoint (Qwen3-Next's
    layers with the demo model's tokenizer and chat template) answers the official client's chat request with
    transformers' greedy reply to the same rendered prompt."""
    from transformers import AutoTokenizer

    seed = random.randrange(2**31)
    model = str(tmp_path / "hybrid")
    os.makedirs(model)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # copied: the module's demo checkpoint stays as it is
        shutil.copy(os.path.join(demo_dir, name), model)
    with open(os.path.join(demo_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    hf = make_hf_model("qwen3_next", model, seed=seed, vocab_size=vocab)
    tokenizer = AutoTokenizer.from_pretrained(model)
    messages = [{"role": "user", "content": "Name three rivers of Europe, briefly."}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                          eos_token_id=hf.config.eos_token_id, pad_token_id=hf.config.eos_token_id)
    generated = [t for t in out[0, len(prompt):].tolist() if t != hf.config.eos_token_id]

    port = free_port()
    proc, key = start_server(model, f"sqlite:///{tmp_path / 'policy.db'}", port, "--data-dir", str(tmp_path / "data"),
                             "--served-model-name", "hybrid", "--reasoning-parser", "none", "--tool-call-parser", "none")
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_ready(url))
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="hybrid", messages=messages, max_tokens=8, temperature=0)
    finally:
        stop_server(proc)
    assert reply.usage.prompt_tokens == len(prompt), f"seed={seed}"
    assert reply.usage.completion_tokens == len(generated), f"seed={seed}"
    assert reply.choices[0].message.content == tokenizer.decode(generated, skip_special_tokens=True), f"seed={seed}"
