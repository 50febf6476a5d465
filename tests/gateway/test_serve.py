"""The single-tenant serving path: HTTP -> engine process -> HTTP, against the offline engine as reference."""

import asyncio
import json
import random

import pytest
from aiohttp.test_utils import TestClient, TestServer

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.demo_model import write_demo_model
from gateway.app import create_app
from gateway.config import GatewayConfig


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("demo"))
    write_demo_model(path, seed=random.randrange(1000))
    return path


def _serve(demo_dir):
    engine = AsyncEngine(EngineConfig(model=demo_dir, num_kv_blocks=128, max_num_batched_tokens=64))
    return TestClient(TestServer(create_app(GatewayConfig(served_model_name="demo"), engine)))


def test_completions_match_offline_engine_and_stream(demo_dir):
    prompts = ["The quick brown fox", "Once upon a time there", "Hello"]
    offline = LLM(model=demo_dir, num_kv_blocks=128).generate(
        prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )

    async def scenario():
        async with _serve(demo_dir) as client:
            models = await (await client.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == ["demo"]
            bodies = [{"model": "demo", "prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True} for p in prompts]
            # Concurrent requests share engine steps; each must still equal its offline result.
            resps = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
            for resp, ref in zip(resps, offline):
                assert resp.status == 200
                data = await resp.json()
                assert data["choices"][0]["text"] == ref.text
                assert data["choices"][0]["finish_reason"] == "length"
                assert data["usage"]["completion_tokens"] == 10 and data["usage"]["prompt_tokens"] == ref.num_prompt_tokens

            resp = await client.post("/v1/completions", json=dict(bodies[0], stream=True))
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            events = [line[6:] for line in (await resp.text()).splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert "".join(c["choices"][0]["text"] for c in chunks) == offline[0].text
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"

            chat = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            assert chat.status == 200
            assert (await chat.json())["choices"][0]["message"]["role"] == "assistant"

    asyncio.run(scenario())


def test_bad_requests_get_openai_errors(demo_dir):
    async def scenario():
        async with _serve(demo_dir) as client:
            cases = [
                ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
                ({"prompt": "x", "temperature": 5}, 400, "temperature"),
                ({"prompt": [1, 2, 10**9]}, 400, "prompt"),
                ({"prompt": "x", "model": "gpt-9"}, 404, "model"),
                ({"max_tokens": 3}, 400, None),
            ]
            for body, status, param in cases:
                resp = await client.post("/v1/completions", json=body)
                err = (await resp.json())["error"]
                assert resp.status == status, (body, err)
                assert err["message"] and err["type"]
                if param:
                    assert err["param"] == param, (body, err)
            resp = await client.post("/v1/completions", data=b"{not json")
            assert resp.status == 400 and "JSON" in (await resp.json())["error"]["message"]
            # The server still serves after the errors.
            ok = await client.post("/v1/completions", json={"prompt": "fine", "max_tokens": 2})
            assert ok.status == 200

    asyncio.run(scenario())
