"""Several choices, prompt forms, /tokenize and /detokenize, and admission without max_tokens, through the
official `openai` client against one server on the demo checkpoint.

References: separate n=1 requests on the same server (greedy), transformers' AutoTokenizer, and the
usage ledger in the policy database.
"""

import asyncio
import random

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer
from transformers import AutoTokenizer

from engine.core.config import EngineConfig
from engine.loading.demo_model import write_demo_model
from engine.serving.async_engine import AsyncEngine
from gateway.admission import INFLIGHT
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.cli import main as moegate_main
from tenants.migrate import upgrade
from tenants.store import TenantStore
from tests.gateway.tenant_keys import new_tenant_key

BLOCK = 16  # EngineConfig's default block size
MAX_MODEL_LEN = 128
ESTIMATE = 16  # default_reservation_tokens in this server
WORDS = "apple river stone cloud seven orange quiet bright paper window garden silver".split()


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("demo"))
    write_demo_model(path, seed=random.randrange(1000))
    return path


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def _tenants(url: str) -> dict[str, str]:
    return {name: await new_tenant_key(url, name) for name in ("t", "capped")}


async def _usage(url: str, tenant: str) -> list[dict]:
    store = TenantStore.open(url)
    try:
        return await store.usage_summary(tenant, by="tenant")
    finally:
        await store.close()


@pytest.mark.timeout(300)
def test_choices_prompts_tokenize_and_quota(demo_dir, tmp_path):
    url = f"sqlite:///{tmp_path / 'policy.db'}"
    upgrade(url)
    keys = asyncio.run(_tenants(url))
    # Per request: 100 tokens, under the 128-token context (what a request without max_tokens used to reserve)
    # and over the prompt plus the 16-token estimate.
    assert moegate_main(["admin", "quota", "set", "capped", "--max-tokens", "100", "--database-url", url]) == 0
    rng = random.Random()
    hf_tokenizer = AutoTokenizer.from_pretrained(demo_dir)

    async def scenario():
        engine = AsyncEngine(EngineConfig(model=demo_dir, num_kv_blocks=128, max_num_batched_tokens=256,
                                          max_num_seqs=8, max_model_len=MAX_MODEL_LEN))
        app = create_app(GatewayConfig(served_model_name="demo", database_url=url, data_dir=str(tmp_path / "data"),
                                       default_reservation_tokens=ESTIMATE), engine)
        async with TestServer(app, host="127.0.0.1") as server, \
                aiohttp.ClientSession(headers={"Authorization": f"Bearer {keys['t']}"}) as http:
            client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key=keys["t"], max_retries=0)
            greedy = {"temperature": 0, "extra_body": {"ignore_eos": True}}

            async def post(path, body):
                async with http.post(server.make_url(path), json=body) as r:
                    return r.status, await r.json()

            # n=4, greedy: four identical choices from one prefill of the prompt.
            prompt = _text(rng, rng.randint(30, 45))
            prompts_cut = _text(rng, 9)
            before = engine.stats.total_prefill_tokens if engine.stats else 0
            res = await client.completions.create(model="demo", prompt=prompt, n=4, max_tokens=8, **greedy)
            assert [c.index for c in res.choices] == [0, 1, 2, 3]
            assert len({c.text for c in res.choices}) == 1
            length = res.usage.prompt_tokens
            tail = length - (length - 1) // BLOCK * BLOCK  # what each copy computes past the shared blocks
            prefill = engine.stats.total_prefill_tokens - before
            assert length <= prefill <= length + 3 * tail, (prefill, length)
            assert res.usage.completion_tokens == 32
            single = await client.completions.create(model="demo", prompt=prompt, max_tokens=8, **greedy)
            assert single.choices[0].text == res.choices[0].text
            assert res.system_fingerprint and res.system_fingerprint == single.system_fingerprint

            # Sampled with a seed: the same request gives the same choices again.
            messages = [{"role": "user", "content": _text(rng, 12)}]
            seed = rng.randrange(2**31)
            a, b = [await client.chat.completions.create(model="demo", messages=messages, n=3, seed=seed,
                                                         temperature=1.0, max_tokens=8) for _ in range(2)]
            assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
            assert [c.index for c in a.choices] == [0, 1, 2]

            # Streamed n=2: chunks carry their choice's index; each choice's text is the n=1 answer.
            alone = await client.chat.completions.create(model="demo", messages=messages, max_tokens=6, **greedy)
            stream = await client.chat.completions.create(model="demo", messages=messages, n=2, max_tokens=6,
                                                          stream=True, stream_options={"include_usage": True}, **greedy)
            texts, finishes = {0: "", 1: ""}, {}
            async for chunk in stream:
                for c in chunk.choices:
                    texts[c.index] += c.delta.content or ""
                    if c.finish_reason:
                        finishes[c.index] = c.finish_reason
                if chunk.usage is not None:
                    usage = chunk.usage
            assert texts == {0: alone.choices[0].message.content, 1: alone.choices[0].message.content}
            assert finishes == {0: "length", 1: "length"}
            assert usage.completion_tokens == 12 and usage.prompt_tokens == alone.usage.prompt_tokens

            # A client that goes away stops every copy: the engine runs nothing and holds no block after.
            decoded = engine.stats.total_decode_tokens
            room = MAX_MODEL_LEN - length  # what the context leaves after the longer prompt: all it may ask for
            cut = await client.completions.create(model="demo", prompt=[prompt, prompts_cut], n=3, max_tokens=room,
                                                  stream=True, **greedy)
            seen = 0
            async for chunk in cut:
                seen += 1
                if seen == 8:
                    break
            await cut.close()
            for _ in range(100):
                await asyncio.sleep(0.05)
                stats = engine.stats
                idle = stats.num_running == 0 and not any(stats.num_waiting_by_priority.values()) and stats.kv_blocks_used == 0
                if idle and app[INFLIGHT].get(1, 0) == 0:
                    break
            assert (stats.num_running, stats.kv_blocks_used, app[INFLIGHT].get(1, 0)) == (0, 0, 0), stats
            assert stats.total_decode_tokens - decoded < 6 * room / 2  # stopped early, not run to the end

            # A list of prompts: one choice each, in order, equal to separate requests; token ids too, with n.
            prompts = [_text(rng, rng.randint(3, 20)) for _ in range(3)]
            listed = await client.completions.create(model="demo", prompt=prompts, max_tokens=6, **greedy)
            separate = [await client.completions.create(model="demo", prompt=p, max_tokens=6, **greedy) for p in prompts]
            assert [c.index for c in listed.choices] == [0, 1, 2]
            assert [c.text for c in listed.choices] == [s.choices[0].text for s in separate]
            assert listed.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in separate)
            assert listed.usage.completion_tokens == 18
            ids = [hf_tokenizer.encode(p) for p in prompts]
            by_ids = await client.completions.create(model="demo", prompt=ids, n=2, max_tokens=6, **greedy)
            assert [c.text for c in by_ids.choices] == [s.choices[0].text for s in separate for _ in range(2)]
            echoed = await client.completions.create(model="demo", prompt=prompts[:2], n=2, max_tokens=6, echo=True,
                                                     logprobs=1, **greedy)
            assert [c.text for c in echoed.choices] == [p + s.choices[0].text for p, s in zip(prompts[:2], separate)
                                                        for _ in range(2)]
            # Every copy: the prompt's tokens, then the 6 generated ones, each with its logprob.
            for i, choice in enumerate(echoed.choices):
                assert len(choice.logprobs.tokens) == separate[i // 2].usage.prompt_tokens + 6, choice.logprobs.tokens
                assert choice.logprobs.token_logprobs[0] is None and None not in choice.logprobs.token_logprobs[1:]
            one_ids = await client.completions.create(model="demo", prompt=ids[0], max_tokens=6, **greedy)
            assert [c.text for c in one_ids.choices] == [separate[0].choices[0].text]

            # Text content parts are joined by newlines; an image to this text model is refused naming its part,
            # other part types by their type.
            parts = [{"type": "text", "text": _text(rng, 4)}, {"type": "text", "text": _text(rng, 4)}]
            as_parts = await client.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": parts}], max_tokens=5, **greedy)
            as_text = await client.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": parts[0]["text"] + "\n" + parts[1]["text"]}],
                max_tokens=5, **greedy)
            assert as_parts.choices[0].message.content == as_text.choices[0].message.content
            assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens
            image = {"type": "image_url", "image_url": {"url": "http://example.invalid/x.png"}}
            audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
            refusals = [
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": [parts[0], image]}]},
                 "messages[0].content[1]"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": [parts[0], audio]}]},
                 "messages[0].content[1].type"),
                ("/v1/completions", {"prompt": "x", "n": 129}, "n"),
                ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 50}, "n"),
                ("/v1/completions", {"prompt": ["a", [1, 2]]}, "prompt"),
                ("/v1/completions", {"prompt": [[1, 2], []]}, "prompt[1]"),
                ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
                ("/detokenize", {"tokens": [hf_tokenizer.vocab_size + 10_000]}, "tokens"),
            ]
            for path, body, param in refusals:
                status, answer = await post(path, body)
                assert status == 400 and answer["error"]["param"] == param, (path, body, answer)

            # stop_reason: the stop string that ended a choice; None where the length did.
            text = separate[0].choices[0].text
            stop = next((text[i:i + 3] for i in range(1, len(text) - 3) if text[i:i + 3].strip()), None)
            if stop is not None:
                stopped = await client.completions.create(model="demo", prompt=prompts[0], max_tokens=6, stop=[stop],
                                                          **greedy)
                assert stopped.choices[0].finish_reason == "stop"
                assert stopped.choices[0].model_extra["stop_reason"] == stop
            assert separate[0].choices[0].model_extra["stop_reason"] is None
            eos = await client.completions.create(model="demo", prompt=prompts[0], max_tokens=6, temperature=0,
                                                  logit_bias={str(hf_tokenizer.eos_token_id): 100})
            assert eos.choices[0].finish_reason == "stop" and eos.choices[0].model_extra["stop_reason"] is None

            # /tokenize and /detokenize against the checkpoint's tokenizer, on random text.
            for _ in range(3):
                sample = _text(rng, rng.randint(1, 30)) + rng.choice(["", "!", " 42", "\n"])
                status, tok = await post("/tokenize", {"model": "demo", "prompt": sample})
                assert status == 200 and tok["tokens"] == hf_tokenizer.encode(sample), tok
                assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == MAX_MODEL_LEN
                status, detok = await post("/detokenize", {"model": "demo", "tokens": tok["tokens"]})
                assert status == 200 and detok["prompt"] == hf_tokenizer.decode(tok["tokens"])
            status, tok = await post("/tokenize", {"messages": messages})
            assert status == 200 and tok["count"] == alone.usage.prompt_tokens
            async with aiohttp.ClientSession() as anonymous:
                async with anonymous.post(server.make_url("/tokenize"), json={"prompt": "x"}) as r:
                    assert r.status == 401

            # Without max_tokens a request reserves the estimate, not the whole context, so a tenant whose
            # per-request limit is under the context is admitted; the ledger gets what it really used.
            capped = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key=keys["capped"], max_retries=0)
            long_run = await capped.chat.completions.create(model="demo", messages=messages, **greedy)
            assert long_run.choices[0].finish_reason == "length"
            assert long_run.usage.prompt_tokens + long_run.usage.completion_tokens == MAX_MODEL_LEN  # past 100
            with pytest.raises(openai.BadRequestError) as refused:  # asking for the whole context is refused
                await capped.chat.completions.create(model="demo", messages=messages, max_tokens=110, **greedy)
            assert refused.value.body["param"] == "max_tokens"
            return long_run.usage

    long_usage = asyncio.run(scenario())
    (row,) = asyncio.run(_usage(url, "capped"))  # the server has closed: its ledger is written
    assert row["requests"] == 1
    assert (row["prompt_tokens"], row["completion_tokens"]) == (long_usage.prompt_tokens, long_usage.completion_tokens)
