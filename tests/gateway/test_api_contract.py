"""What the API promises: OpenAI's defaults, reservations no larger than the context allows, an OpenAPI
document that refuses what the server refuses, unknown and unimplemented fields refused by name (never
dropped), explicit nulls taken as defaults, and 405s that say which methods are allowed."""

import asyncio
import json
import random
import time

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from engine.serving.async_engine import AsyncEngine
from engine.core.config import EngineConfig
from engine.loading.demo_model import write_demo_model
from gateway.app import create_app
from gateway.config import GatewayConfig
from tenants.migrate import upgrade
from tests.gateway.tenant_keys import new_tenant_key


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("demo"))
    write_demo_model(path, seed=random.randrange(1000))
    return path


@pytest.mark.timeout(240)
def test_defaults_reservations_schema_and_allow(demo_dir, tmp_path):
    url = f"sqlite:///{tmp_path / 'policy.db'}"
    upgrade(url)
    engine = AsyncEngine(EngineConfig(model=demo_dir, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
                                      max_model_len=512))
    app = create_app(GatewayConfig(served_model_name="demo", database_url=url, data_dir=str(tmp_path / "data")), engine)

    async def scenario():
        key = await new_tenant_key(url, tokens_per_minute=2_000)
        async with TestServer(app, host="127.0.0.1") as server, \
                aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http:
            async def post(path, body):
                async with http.post(server.make_url(path), json=body) as r:
                    return r.status, await r.json()

            # /v1/completions without max_tokens: 16 tokens, as OpenAI's API.
            status, answer = await post("/v1/completions", {"prompt": "hello", "ignore_eos": True})
            assert status == 200 and answer["usage"]["completion_tokens"] == 16, answer

            # A max_tokens past the context is a 400 naming it and the numbers (OpenAI's and vLLM's answer), never
            # cut short silently; left out on chat, the output fills the context (512 tokens here), and the
            # reservation is only what the context leaves room for, so a 2,000 tokens-per-minute limit admits it.
            status, answer = await post("/v1/completions", {"prompt": "hello", "max_tokens": 200_000, "ignore_eos": True})
            assert status == 400 and answer["error"]["param"] == "max_tokens", answer
            assert "512" in answer["error"]["message"] and "200,000" in answer["error"]["message"], answer
            status, answer = await post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                 "ignore_eos": True})
            assert status == 200, answer
            assert answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"] == 512

            # What the server refuses, the OpenAPI document refuses too.
            async with http.get(server.make_url("/openapi.json")) as r:
                schemas = (await r.json())["components"]["schemas"]
            chat, completion = schemas["ChatCompletionRequest"], schemas["CompletionRequest"]
            assert chat["properties"]["messages"]["minItems"] == 1
            assert {"minLength": 1} .items() <= completion["properties"]["prompt"]["anyOf"][0].items()
            assert completion["properties"]["n"]["anyOf"][0]["maximum"] == 128
            assert chat["additionalProperties"] is False and completion["additionalProperties"] is False
            assert chat["properties"]["functions"]["enum"] == [None, []]
            for path, body, param in [("/v1/chat/completions", {"messages": []}, "messages"),
                                      ("/v1/completions", {"prompt": ""}, "prompt"),
                                      ("/v1/completions", {"prompt": []}, "prompt"),
                                      ("/v1/completions", {"prompt": "x", "n": 129}, "n"),
                                      ("/v1/completions", {"prompt": "x", "temperature": 2.5}, "temperature"),
                                      ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop")]:
                status, answer = await post(path, body)
                assert status == 400 and answer["error"]["param"] == param, (body, answer)

            # Unknown fields are refused, naming them (nested ones by their path); OpenAI's fields that this
            # server does not implement are refused when they ask for something, accepted when null or "off";
            # an explicit null is the default.
            word = "".join(random.choice("abcdefghij") for _ in range(8))
            for path, body, param in [
                ("/v1/completions", {"prompt": "x", word: 1}, word),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", word: True}]},
                 f"messages[0].{word}"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                          "stream_options": {word: 1}}, f"stream_options.{word}"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                          "tools": [{"type": "function", "function": {"name": "f", word: 1}}]},
                 f"tools[0].function.{word}"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                          "functions": [{"name": "f"}]}, "functions"),
                ("/v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
                ("/v1/completions", {"prompt": "x", "presence_penalty": random.uniform(2.01, 9)}, "presence_penalty"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                          "response_format": {"type": "xml"}}, "response_format.type"),
                # A missing field is named itself, not the object that lacks it; a bad value in a map by the map.
                ("/v1/completions", {"max_tokens": 2}, "prompt"),
                ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages[0].role"),
                ("/v1/completions", {"prompt": "x", "logit_bias": {"7": 101}}, "logit_bias"),
                # JSON's types are the fields' types: a number in a string, 1 for true, "null" for null are
                # refused (msgspec's lax mode would take them), as OpenAI refuses them.
                ("/v1/completions", {"prompt": "x", "max_tokens": "2"}, "max_tokens"),
                ("/v1/completions", {"prompt": "x", "temperature": "0.5"}, "temperature"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": 1}, "stream"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": "true"},
                 "logprobs"),
                ("/v1/completions", {"prompt": "x", "echo": "null"}, "echo"),
                ("/v1/completions", {"prompt": "x", "logit_bias": {"7": "5"}}, "logit_bias"),
                # As OpenAI: stream_options only with stream: true, and content parts not an empty list.
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                          "stream_options": {"include_usage": True}}, "stream_options"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": []}, "tools"),
            ]:
                status, answer = await post(path, body)
                assert status == 400 and answer["error"]["param"] == param, (body, answer)
            status, answer = await post("/v1/chat/completions", {
                "messages": [{"role": "user", "content": "x", "name": "ann"}], "max_tokens": 2, "temperature": None,
                "top_p": None, "n": None, "stream": None, "stop": None, "seed": None, "tools": None,
                "logprobs": False, "presence_penalty": 0, "frequency_penalty": 0.0, "parallel_tool_calls": True})
            assert status == 200 and answer["usage"]["completion_tokens"] <= 2, answer

            # The official client sees the same: a BadRequestError that names the field.
            import openai

            client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key=key, max_retries=0)
            with pytest.raises(openai.BadRequestError) as refused:
                await client.completions.create(model="demo", prompt="x", max_tokens=2, extra_body={word: 1})
            assert refused.value.body["param"] == word and word in refused.value.body["message"]
            # A model by name: the served one, or a 404 naming what is served.
            card = await client.models.retrieve("demo")
            assert card.id == "demo" and card.object == "model"
            assert abs(card.created - time.time()) < 600, card  # a real unix time (when the server started)
            assert (await client.models.list()).data[0].created == card.created
            with pytest.raises(openai.NotFoundError) as missing:
                await client.models.retrieve(word)
            assert missing.value.body["code"] == "model_not_found" and "'demo'" in missing.value.body["message"]
            await client.close()

            # JSON Schema counts 1.0 as an integer, so the server takes it as one; 1.5 is refused.
            status, answer = await post("/v1/completions", {"prompt": "hi", "n": 1.0, "max_tokens": 2.0})
            assert status == 200 and answer["usage"]["completion_tokens"] <= 2, answer
            status, answer = await post("/v1/completions", {"prompt": [[5.0, 6.0], [7]], "max_tokens": 2.0,
                                                            "temperature": 1, "echo": True})
            assert status == 200 and answer["usage"]["prompt_tokens"] == 3, answer
            status, answer = await post("/v1/completions", {"prompt": "hi", "max_tokens": 2.5})
            assert status == 400 and answer["error"]["param"] == "max_tokens", answer

            # A 405 says which methods the route has.
            async with http.get(server.make_url("/v1/completions")) as r:
                assert r.status == 405 and r.headers["Allow"] == "POST"
                assert json.loads(await r.text())["error"]["type"] == "invalid_request_error"

    asyncio.run(scenario())
