"""Logprobs, echo, penalties, logit_bias, min_tokens, stop_token_ids and seed through the official `openai` client
against an in-process server on the demo checkpoint; values against transformers' logits of the same checkpoint."""

import asyncio
import random

import openai
import pytest
import torch

from tests.gateway.in_process import in_process_server
from tests.gateway.tenant_keys import new_tenant_key

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(demo dir, transformers model, tokenizer, run) where run(coroutine_fn) calls coroutine_fn(client) against
    one server started for the module."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with in_process_server(tmp_path_factory.mktemp("sampling_api"), dict(
            dtype="float32", num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=512)) as srv:
        hf = AutoModelForCausalLM.from_pretrained(srv.demo, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(srv.demo)
        client = openai.AsyncOpenAI(base_url=srv.base_url, api_key=srv.run(new_tenant_key(srv.database_url)),
                                    max_retries=0)
        yield hf, tok, lambda fn: srv.run(fn(client))
        srv.run(client.close())


def hf_continue(hf, prompt: list[int], n: int, banned: int | None = None, ban_steps: int = 0,
                stop: int | None = None) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of ``prompt`` and the float64 log-softmax [P + n, V] over it all;
    ``banned`` is never chosen in the first ``ban_steps`` steps (min_tokens); generation ends at ``stop``."""
    ids = list(prompt)
    with torch.no_grad():
        for step in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1]
            if step < ban_steps:
                logits[banned] = float("-inf")
            ids.append(int(logits.argmax()))
            if ids[-1] == stop:
                break
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)
    return ids[len(prompt):], logp


def test_completion_echo_logprobs_match_transformers(served):
    hf, tok, run = served
    rng = random.Random()
    prompt = [rng.randrange(3, tok.vocab_size) for _ in range(rng.randint(5, 40))]  # past the specials
    generated, logp = hf_continue(hf, prompt, 6)
    ids = prompt + generated

    async def go(client):
        whole = await client.completions.create(model="demo", prompt=prompt, max_tokens=6, temperature=0, echo=True,
                                                logprobs=3, extra_body={"ignore_eos": True})
        chunks = await client.completions.create(model="demo", prompt=prompt, max_tokens=6, temperature=0, echo=True,
                                                 logprobs=3, stream=True, extra_body={"ignore_eos": True})
        streamed = [c async for c in chunks]
        text = await client.completions.create(model="demo", prompt="the river", max_tokens=3, echo=True)
        return whole, streamed, text

    answer, streamed, text_echo = run(go)
    assert text_echo.choices[0].text.startswith("the river") and text_echo.choices[0].logprobs is None
    parts = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == answer.choices[0].logprobs.tokens
    assert [o for p in parts for o in p.text_offset] == answer.choices[0].logprobs.text_offset
    assert [v for p in parts for v in p.token_logprobs] == pytest.approx(answer.choices[0].logprobs.token_logprobs,
                                                                          abs=1e-4)
    choice = answer.choices[0]
    lp = choice.logprobs
    assert answer.usage.prompt_tokens == len(prompt) and answer.usage.completion_tokens == 6
    assert lp.tokens == [tok.decode([t]) for t in ids]
    # echo: the prompt's text (a token-id prompt: its tokens' texts), then the completion's
    assert choice.text.startswith("".join(lp.tokens[:len(prompt)])) and len(choice.text) > len("".join(lp.tokens[:len(prompt)]))
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    for pos in range(1, len(ids)):
        row = logp[pos - 1]
        assert lp.token_logprobs[pos] == pytest.approx(row[ids[pos]].item(), abs=2e-4)
        top = lp.top_logprobs[pos]
        want = {tok.decode([t]): v for t, v in zip(row.topk(3).indices.tolist(), row.topk(3).values.tolist())}
        want.setdefault(tok.decode([ids[pos]]), row[ids[pos]].item())  # the chosen token, as OpenAI adds it
        assert top.keys() == want.keys() and list(top.values()) == pytest.approx(list(want.values()), abs=2e-4)


def test_chat_logprobs_shape_and_streaming(served):
    hf, tok, run = served
    k = random.randint(2, 20)  # at least the chosen token and its runner-up (a near tie is judged by both)
    messages = [{"role": "user", "content": "tell me about the river"}]

    async def go(client):
        whole = await client.chat.completions.create(model="demo", messages=messages, max_tokens=8, temperature=0,
                                                     logprobs=True, top_logprobs=k, extra_body={"ignore_eos": True})
        chunks = await client.chat.completions.create(model="demo", messages=messages, max_tokens=8, temperature=0,
                                                      logprobs=True, top_logprobs=k, stream=True,
                                                      extra_body={"ignore_eos": True})
        streamed = [c async for c in chunks]
        return whole, streamed

    whole, streamed = run(go)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 8
    if not any("\ufffd" in c.token for c in content):  # a byte fragment's own text is not the detokenized text's
        # With ignore_eos the model may sample a special token (EOS among them): it has a logprob entry, while
        # the message's text skips special tokens (skip_special_tokens, the default).
        # (all_special_tokens lists only the named ones: <|im_start|> is special in added_tokens_decoder alone)
        special = {t.content for t in tok.added_tokens_decoder.values() if t.special}
        assert "".join(c.token for c in content if c.token not in special) == whole.choices[0].message.content
    for c in content:
        assert c.bytes == list(c.token.encode()) and len(c.top_logprobs) == k
        values = [t.logprob for t in c.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob  # greedy: the top one
    parts = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(parts) == len(content)
    # The streamed run reads the prompt's KV from the prefix cache: the same values up to float rounding, so
    # the same greedy tokens unless two candidates of the random model tie within that rounding. Up to the
    # first difference everything is equal; a difference must be such a tie (both runs list both tokens).
    split = next((i for i, (p, c) in enumerate(zip(parts, content)) if p.token != c.token), len(content))
    assert [p.token for p in parts[:split]] == [c.token for c in content[:split]]
    assert [p.logprob for p in parts[:split]] == pytest.approx([c.logprob for c in content[:split]], abs=1e-4)
    if split < len(content):
        theirs = {t.token: t.logprob for t in content[split].top_logprobs}
        ours = {t.token: t.logprob for t in parts[split].top_logprobs}
        assert parts[split].token in theirs and content[split].token in ours, (parts[split], content[split])
        assert theirs[parts[split].token] == pytest.approx(content[split].logprob, abs=1e-4)
        assert ours[content[split].token] == pytest.approx(parts[split].logprob, abs=1e-4)


def test_logit_bias_penalties_stop_ids_seed_and_errors(served):
    hf, tok, run = served
    rng = random.Random()
    forced = rng.randrange(3, tok.vocab_size)
    prompt = [rng.randrange(3, tok.vocab_size) for _ in range(12)]
    greedy, _ = hf_continue(hf, prompt, 8)

    async def go(client):
        out = {}
        # logit_bias +100 forces a token; the logprobs reported stay the model's own (raw).
        out["bias"] = await client.completions.create(
            model="demo", prompt=prompt, max_tokens=5, temperature=1.0, logprobs=0, logit_bias={str(forced): 100},
            extra_body={"ignore_eos": True})
        # A strong repetition penalty changes a greedy continuation that repeats; here: it is accepted and applied
        # (the engine's tests compare the values with a reference); stop_token_ids and min_tokens act by id.
        stop_at = greedy[3]
        out["stop"] = await client.completions.create(
            model="demo", prompt=prompt, max_tokens=8, temperature=0, extra_body={"stop_token_ids": [stop_at],
                                                                                   "ignore_eos": True})
        out["min"] = await client.completions.create(
            model="demo", prompt=prompt, max_tokens=8, temperature=0, extra_body={
                "stop_token_ids": [greedy[0]], "min_tokens": 2, "ignore_eos": True})
        seeded = dict(model="demo", prompt=prompt, max_tokens=10, temperature=1.0, seed=rng.randrange(2**31),
                      extra_body={"ignore_eos": True})
        out["alone"] = await client.completions.create(**seeded)
        crowd = await asyncio.gather(
            client.completions.create(**seeded),
            *[client.completions.create(model="demo", prompt=prompt[:i + 2], max_tokens=12, temperature=1.0,
                                        presence_penalty=1.5, frequency_penalty=-1,
                                        extra_body={"ignore_eos": True, "repetition_penalty": 1.3, "min_p": 0.1})
              for i in range(4)])
        out["crowd"] = crowd[0]
        errors = {}
        for name, kwargs in [
            ("logit_bias", dict(logit_bias={str(tok.vocab_size + 10**6): 1})),
            ("logit_bias", dict(logit_bias={"abc": 1})),
            ("logprobs", dict(logprobs=6)),
            ("stop_token_ids", dict(extra_body={"stop_token_ids": [10**8]})),
            ("min_tokens", dict(extra_body={"min_tokens": 9})),
            ("frequency_penalty", dict(frequency_penalty=-2.5)),
            ("repetition_penalty", dict(extra_body={"repetition_penalty": 0})),
            ("min_p", dict(extra_body={"min_p": 1.5})),
        ]:
            with pytest.raises(openai.BadRequestError) as refused:
                await client.completions.create(model="demo", prompt="x", max_tokens=8, **kwargs)
            errors[name] = refused.value.body
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}],
                                                 top_logprobs=2)
        errors["top_logprobs"] = refused.value.body
        return out, errors

    out, errors = run(go)
    bias = out["bias"].choices[0]
    assert bias.logprobs.tokens == [tok.decode([forced])] * 5
    assert all(v < -1e-3 for v in bias.logprobs.token_logprobs)  # not the biased ~0: the model's own
    stop = out["stop"].choices[0]
    assert stop.finish_reason == "stop" and out["stop"].usage.completion_tokens == greedy.index(greedy[3]) + 1
    # min_tokens 2: the stop token greedy[0] is not allowed before 2 tokens exist, then it stops the request.
    min_ref, _ = hf_continue(hf, prompt, 8, banned=greedy[0], ban_steps=2, stop=greedy[0])
    assert out["min"].usage.completion_tokens == len(min_ref)
    assert out["min"].choices[0].finish_reason == ("stop" if min_ref[-1] == greedy[0] else "length")
    assert out["crowd"].choices[0].text == out["alone"].choices[0].text
    for param, body in errors.items():
        assert body["param"] == param, (param, body)
