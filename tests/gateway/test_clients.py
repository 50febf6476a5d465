"""Third-party clients against an in-process server on the demo checkpoint: the official `openai` client's
own message objects sent back, LangChain's tool and structured-output helpers, and the request bodies that
GuideLLM, AIPerf and lm-eval send (copied from their sources), replayed byte for byte. Values against
transformers' logits and tokenizer of the same checkpoint, JSON against the independent `jsonschema`."""

import asyncio
import functools
import json
import random
import re

import aiohttp
import jsonschema
import openai
import pytest
import torch

from tests.gateway.in_process import in_process_server
from tests.gateway.tenant_keys import new_tenant_key

pytestmark = pytest.mark.timeout(240)

NOTE = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]}
TOOLS = [{"type": "function", "function": {"name": "take_note", "description": "Write a note", "parameters": NOTE}},
         {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
             "type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}}, "required": ["city"]}}}]
USER = [{"role": "user", "content": "Write down that the river is high."}]


class Served:
    """One server for the module: ``run(fn)`` awaits ``fn(client)`` with the official async client; ``post``
    sends a raw body and returns (status, JSON or the SSE events)."""

    def __init__(self, loop, server, key, demo: str):
        from transformers import AutoTokenizer

        self.loop, self.server, self.key, self.demo = loop, server, key, demo
        self.tok = AutoTokenizer.from_pretrained(demo)
        self.base_url = str(server.make_url("/v1"))
        self.client = openai.AsyncOpenAI(base_url=self.base_url, api_key=key, max_retries=0)

    @functools.cached_property
    def hf(self):
        """transformers' float32 model of the checkpoint (loaded by the first test that compares values)."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.demo, dtype=torch.float32).eval()

    def run(self, fn):
        return self.loop.run_until_complete(fn(self.client))

    def post(self, path: str, body: dict):
        async def go():
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {self.key}"}) as http:
                async with http.post(self.server.make_url(path), json=body) as r:
                    if not body.get("stream") or r.status != 200:
                        return r.status, await r.json()
                    text = await r.text()
            lines = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
            assert lines[-1] == "[DONE]", lines[-3:]
            return r.status, [json.loads(line) for line in lines[:-1]]

        return self.loop.run_until_complete(go())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with in_process_server(tmp_path_factory.mktemp("clients"), dict(
            dtype="float32", num_kv_blocks=512, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=2048)) as srv:
        served = Served(srv.loop, srv.server, srv.run(new_tenant_key(srv.database_url)), srv.demo)
        yield served
        srv.run(served.client.close())


def _prompt_tokens(tok, messages: list[dict], **kwargs) -> int:
    return len(tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)))


def _log_softmax(hf, ids: list[int]) -> torch.Tensor:
    """transformers' float64 log-softmax [len(ids), V] over ``ids``."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)


def _assistant_turn(message) -> dict:
    """An assistant reply as transformers' template reads it (arguments as objects)."""
    turn = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        turn["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in message.tool_calls]
    return turn


def test_replies_sent_back_as_the_client_returned_them(served):
    """The openai SDK's message object appended to the conversation, and its model_dump() (which adds
    refusal, annotations, audio, function_call: null and keeps the server's reasoning_content), are taken
    and rendered as the assistant turn they are; so are a forced tool call's and a streamed reply's."""
    weather = {"type": "function", "function": {"name": "get_weather"}}
    follow_up = {"role": "user", "content": "And tomorrow?"}

    # Text that spells a control token (the random model may answer "<tool_call>") is sent back as text, never as
    # the token (test_chat_safety), which a template rendered and encoded whole would not do: such replies are
    # drawn again, so the reference below counts what the gateway renders.
    controls = list(served.tok.get_added_vocab())

    async def go(client):
        for _ in range(50):
            seed = random.randrange(2**31)
            reply = (await client.chat.completions.create(model="demo", messages=USER, max_tokens=6,
                                                          seed=seed)).choices[0]
            if not any(c in (reply.message.content or "") for c in controls):
                break
        called = (await client.chat.completions.create(model="demo", messages=USER, max_tokens=40, seed=seed,
                                                       tools=TOOLS, tool_choice=weather)).choices[0]
        async with client.chat.completions.stream(model="demo", messages=USER, max_tokens=40, seed=seed, tools=TOOLS,
                                                  tool_choice=weather) as stream:
            streamed = (await stream.get_final_completion()).choices[0]
        answers = []
        for message in (reply.message, called.message, streamed.message):
            for sent in (message, message.model_dump(), message.model_dump(exclude_none=True)):
                history = [*USER, sent]
                if message.tool_calls:
                    history.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "8 degrees"})
                else:
                    history.append(follow_up)
                answers.append((message, await client.chat.completions.create(
                    model="demo", messages=history, max_tokens=1, tools=TOOLS if message.tool_calls else openai.omit)))
        return reply, called, answers

    reply, called, answers = served.run(go)
    dumped = reply.message.model_dump()
    assert {"reasoning_content", "refusal", "annotations", "audio", "function_call"} <= dumped.keys(), dumped
    assert called.message.tool_calls and called.finish_reason == "tool_calls"
    assert len(answers) == 9
    for message, answer in answers:
        history = [*USER, _assistant_turn(message)]
        if message.tool_calls:
            history.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "8 degrees"})
        else:
            history.append(follow_up)
        kwargs = {"tools": TOOLS} if message.tool_calls else {}
        assert answer.usage.prompt_tokens == _prompt_tokens(served.tok, history, **kwargs), message

    # A legacy function_call that is not null is refused by name; reasoning reaches the template's input.
    async def legacy(client):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="demo", max_tokens=1, messages=[
                *USER, {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
                follow_up])
        return refused.value.body

    assert served.run(legacy)["param"] == "messages[1].function_call"
    from gateway.chat_plan import chat_input
    from gateway.openai_schema import ChatCompletionRequest, decode_body

    said = "I cannot help with that."
    body = decode_body(json.dumps({"messages": [*USER, {"role": "assistant", "content": None, "refusal": said},
                                                follow_up]}).encode(), ChatCompletionRequest)
    assert chat_input(body).messages[1] == {"role": "assistant", "content": said}
    thought = "".join(random.choice("abcdef ") for _ in range(12))
    for field in ("reasoning_content", "reasoning"):
        body = decode_body(json.dumps({"messages": [*USER, {"role": "assistant", "content": "ok", field: thought},
                                                    follow_up]}).encode(), ChatCompletionRequest)
        assert chat_input(body).messages[1]["reasoning_content"] == thought


def _words(n: int) -> str:
    return " ".join(random.choice(["river", "bread", "lamp", "mill", "stone"]) for _ in range(n))


def test_usage_on_every_chunk_for_guidellm_and_aiperf(served):
    """stream_options.continuous_usage_stats (GuideLLM's default streaming bodies, chat and text, and
    AIPerf's with --per-chunk-usage): every chunk carries the usage so far, the last one the request's."""
    n = random.randint(5, 12)
    text = _words(6)
    so = {"include_usage": True, "continuous_usage_stats": True}
    bodies = {  # as each tool builds them (GuideLLM's request_handlers.py, AIPerf's openai_chat.py)
        "guidellm chat": ("/v1/chat/completions", {
            "model": "demo", "stream": True, "stream_options": so, "max_completion_tokens": n, "stop": None,
            "ignore_eos": True, "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}),
        "guidellm text": ("/v1/completions", {
            "model": "demo", "stream": True, "stream_options": so, "max_tokens": n, "stop": None, "ignore_eos": True,
            "prompt": text}),
        "aiperf": ("/v1/chat/completions", {
            "messages": [{"role": "user", "name": "text", "content": text}], "model": "demo", "stream": True,
            "max_completion_tokens": n, "stream_options": so, "ignore_eos": True}),
    }
    chat_prompt = _prompt_tokens(served.tok, [{"role": "user", "content": text}])
    for name, (path, body) in bodies.items():
        status, events = served.post(path, body)
        assert status == 200, (name, events)
        prompt = chat_prompt if "chat" in path else len(served.tok.encode(text))
        usages = [e["usage"] for e in events]
        assert all(u is not None for u in usages), (name, usages)
        assert all(u["prompt_tokens"] == prompt and u["total_tokens"] == prompt + u["completion_tokens"]
                   for u in usages), (name, usages)
        counts = [u["completion_tokens"] for u in usages]
        assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == n, (name, counts)
        assert events[-1]["choices"] == [] and usages[-2] == usages[-1], name  # OpenAI's closing usage chunk
        if "chat" not in path:  # one chunk per decoding step here, each one token: counted as they come
            assert counts[:-1] == list(range(1, n + 1)), (name, counts)
    # include_usage alone: null on every chunk but the last, as OpenAI does.
    status, events = served.post("/v1/completions", {**bodies["guidellm text"][1],
                                                     "stream_options": {"include_usage": True}})
    assert status == 200 and all(e["usage"] is None for e in events[:-1]) and events[-1]["usage"]["completion_tokens"] == n


def test_schemas_without_additional_properties_are_closed(served):
    """A pydantic model's schema (what instructor, LangChain and llama-index send: no additionalProperties)
    as response_format, guided_json and a forced tool's parameters: the model may write only its keys. A bias
    towards '"' keeps strings short and makes a new key the likeliest way on; none appears."""
    from pydantic import BaseModel, Field

    class Person(BaseModel):  # bounded values: the only way to run on is a key of the model's own
        name: str = Field(max_length=8)
        age: int = Field(ge=0, le=120)

    schema = Person.model_json_schema()
    assert "additionalProperties" not in schema
    closed = {**schema, "additionalProperties": False}
    bias = {str(served.tok.convert_tokens_to_ids('"')): 4.0}
    seeds = random.sample(range(2**31), 12)
    messages = [{"role": "user", "content": "Describe a person."}]

    async def go(client):
        def ask(i, seed):
            common = dict(model="demo", messages=messages, temperature=1.0, seed=seed, max_tokens=120, logit_bias=bias)
            if i % 3 == 0:
                return client.chat.completions.create(**common, response_format={
                    "type": "json_schema", "json_schema": {"name": "Person", "schema": schema}})
            if i % 3 == 1:
                return client.chat.completions.create(**common, extra_body={"guided_json": schema})
            return client.chat.completions.create(**common, tools=[{"type": "function", "function": {
                "name": "person", "parameters": schema}}], tool_choice={"type": "function", "function": {"name": "person"}})
        return await asyncio.gather(*(ask(i, s) for i, s in enumerate(seeds)))

    for reply in served.run(go):
        choice = reply.choices[0]
        calls = choice.message.tool_calls
        text = calls[0].function.arguments if calls else choice.message.content
        assert choice.finish_reason in ("stop", "tool_calls"), (choice.finish_reason, text)
        jsonschema.validate(json.loads(text), closed)

    # LangChain as the client: with_structured_output(method="function_calling") sends the schema as it is
    # (its json_schema method goes through the openai SDK's parse helper, which closes objects itself).
    from langchain_openai import ChatOpenAI

    async def langchain(_):
        async def one(seed):
            llm = ChatOpenAI(model="demo", base_url=served.base_url, api_key=served.key, max_tokens=120,
                             max_retries=0, seed=seed, temperature=1.0, logit_bias={int(k): v for k, v in bias.items()})
            return await llm.with_structured_output(Person, method="function_calling", include_raw=True).ainvoke(
                messages[0]["content"])
        return await asyncio.gather(*(one(seed) for seed in seeds[:8]))

    for result in served.run(langchain):
        raw = result["raw"]
        text = raw.tool_calls[0]["args"] if raw.tool_calls else json.loads(raw.content)
        assert isinstance(result["parsed"], Person) and raw.response_metadata["finish_reason"] in ("stop", "tool_calls")
        jsonschema.validate(text, closed)


def test_closed_objects_leave_what_the_schema_says():
    from gateway.response_format import closed_objects

    item = {"type": "object", "properties": {"kind": {"const": {"type": "object"}}}}
    schema = {"type": "object", "properties": {
        "tags": {"type": "object", "additionalProperties": {"type": "integer"}},  # a map: stays open
        "meta": {"type": "object", "additionalProperties": True},
        "items": {"type": "array", "items": item},
        "either": {"anyOf": [{"$ref": "#/$defs/Pet"}, {"type": "null"}]},
        "default": {"type": ["object", "null"], "properties": {}, "default": {"type": "object"}}},
        "$defs": {"Pet": {"properties": {"name": {"type": "string"}}}}}
    out = closed_objects(schema)
    assert out["additionalProperties"] is False and schema.get("additionalProperties") is None  # a copy
    props = out["properties"]
    assert props["tags"]["additionalProperties"] == {"type": "integer"} and props["meta"]["additionalProperties"] is True
    assert props["items"]["items"]["additionalProperties"] is False
    assert props["items"]["items"]["properties"]["kind"] == {"const": {"type": "object"}}  # a value, not a schema
    assert out["$defs"]["Pet"]["additionalProperties"] is False and "additionalProperties" not in props["either"]
    assert props["default"]["additionalProperties"] is False and props["default"]["default"] == {"type": "object"}


def test_forced_tool_call_cut_by_max_tokens(served):
    """A forced call (named or required) that max_tokens cuts comes back as that call with the arguments so
    far and finish_reason "length", streamed or not (as vLLM returns it). A -100 bias on '"' keeps the note's
    string open, so every run is cut inside the arguments."""
    note = [TOOLS[0]]
    quote = served.tok.convert_tokens_to_ids('"')
    seed = random.randrange(2**31)
    cases = {"named": ({"type": "function", "function": {"name": "take_note"}}, 16),
             "required": ("required", 60)}

    async def go(client):
        out = {}
        for name, (choice, max_tokens) in cases.items():
            common = dict(model="demo", messages=USER, tools=note, tool_choice=choice, seed=seed, max_tokens=max_tokens,
                          logit_bias={str(quote): -100}, parallel_tool_calls=False)
            whole = await client.chat.completions.create(**common)
            chunks = [c async for c in await client.chat.completions.create(**common, stream=True)]
            out[name] = whole, chunks
        return out

    for name, (whole, chunks) in served.run(go).items():
        choice = whole.choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None, (name, choice)
        (call,) = choice.message.tool_calls
        assert call.function.name == "take_note" and call.function.arguments.startswith('{"note":"'), (name, call)
        with pytest.raises(ValueError):
            json.loads(call.function.arguments)  # cut: as far as it got
        streamed, finish = {}, None
        for chunk in chunks:
            c = chunk.choices[0]
            finish = c.finish_reason or finish
            assert not c.delta.content
            for d in c.delta.tool_calls or []:
                streamed.setdefault(d.index, {"name": d.function.name, "arguments": ""})
                streamed[d.index]["arguments"] += d.function.arguments or ""
        assert finish == "length" and streamed == {0: {"name": "take_note", "arguments": call.function.arguments}}


def test_langchain_sees_the_cut_call(served):
    """LangChain's bind_tools(tool_choice=NAME) and with_structured_output(method="function_calling") on a cut
    call: the call is there (its arguments incomplete, so LangChain files it as invalid: the structured
    output is None, as with vLLM) with finish_reason "length", where it used to see no call at all."""
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class take_note(BaseModel):
        """Write a note"""
        note: str

    quote = served.tok.convert_tokens_to_ids('"')
    llm = ChatOpenAI(model="demo", base_url=served.base_url, api_key=served.key, max_tokens=16, max_retries=0,
                     seed=random.randrange(2**31), logit_bias={quote: -100})

    async def go(_):
        bound = await llm.bind_tools([TOOLS[0]], tool_choice="take_note").ainvoke([HumanMessage(USER[0]["content"])])
        structured = await llm.with_structured_output(take_note, method="function_calling", include_raw=True).ainvoke(
            USER[0]["content"])
        return bound, structured

    bound, structured = served.run(go)
    for message in (bound, structured["raw"]):
        assert message.response_metadata["finish_reason"] == "length"
        calls = message.tool_calls + message.invalid_tool_calls
        assert [c["name"] for c in calls] == ["take_note"], message
    assert structured["raw"].invalid_tool_calls[0]["args"].startswith('{"note":"')


def test_vllm_text_fields(served):
    """include_stop_str_in_output keeps the stop string (and the ending token's text); skip_special_tokens and
    spaces_between_special_tokens reach the detokenizer (against transformers' decode); cache_control in a
    content part and a null chat_template are accepted, a template of the request's own is refused by name."""
    tok = served.tok
    prompt = [random.randrange(3, 1300) for _ in range(6)]
    special = 1  # <|im_start|>: a special token that is not EOS
    assert special != tok.eos_token_id and tok.added_tokens_decoder[special].special

    async def go(client):
        async def text(**kwargs):
            out = await client.completions.create(model="demo", prompt=prompt, temperature=0, **kwargs)
            return out.choices[0]

        free = await text(max_tokens=12, extra_body={"ignore_eos": True})
        stop_at = next(i for i in range(1, len(free.text) - 1) if free.text[i:i + 2].strip())
        stop = free.text[stop_at:stop_at + 2]
        cut = {k: await text(max_tokens=12, stop=[stop], extra_body={"ignore_eos": True,
                                                                     "include_stop_str_in_output": k})
               for k in (False, True)}
        eos = {str(tok.eos_token_id): 100}
        ends = [await text(max_tokens=3, logit_bias=eos, extra_body=extra) for extra in (
            {}, {"skip_special_tokens": False}, {"skip_special_tokens": False, "include_stop_str_in_output": True})]
        specials = [await text(max_tokens=3, logit_bias={str(special): 100}, extra_body={"ignore_eos": True, **extra})
                    for extra in ({}, {"skip_special_tokens": False, "spaces_between_special_tokens": True},
                                  {"skip_special_tokens": False, "spaces_between_special_tokens": False})]
        chat = {}
        for name, content in (("plain", "hello there"), ("cached", [
                {"type": "text", "text": "hello there", "cache_control": {"type": "ephemeral"}}])):
            chat[name] = await client.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": content}], max_tokens=1,
                extra_body={"chat_template": None})
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="demo", messages=USER, max_tokens=1,
                                                 extra_body={"chat_template": "{{ messages }}"})
        for priority in (5, 0, -3):  # larger waits longer; a negative one cannot raise it, and is not refused
            await client.chat.completions.create(model="demo", messages=USER, max_tokens=1,
                                                 extra_body={"priority": priority})
        return free, stop, cut, ends, specials, chat, refused.value.body

    free, stop, cut, ends, specials, chat, refused = served.run(go)
    at = free.text.find(stop)
    assert cut[False].text == free.text[:at] and cut[True].text == free.text[:at + len(stop)]
    assert cut[True].finish_reason == cut[False].finish_reason == "stop" and cut[True].stop_reason == stop
    assert [e.text for e in ends] == ["", "", tok.eos_token] and all(e.finish_reason == "stop" for e in ends)
    assert specials[0].text == ""
    for choice, spaces in zip(specials[1:], (True, False)):
        assert choice.text == tok.decode([special] * 3, skip_special_tokens=False,
                                         spaces_between_special_tokens=spaces) != ""
    assert chat["cached"].usage.prompt_tokens == chat["plain"].usage.prompt_tokens
    assert refused["param"] == "chat_template"
    from gateway.completion import order_in_class
    from gateway.openai_schema import ChatCompletionRequest, decode_body

    for priority, order in ((None, 0), (7, 7), (-4, 0)):
        body = decode_body(json.dumps({"messages": USER, "priority": priority}).encode(), ChatCompletionRequest)
        assert order_in_class(body) == order


def test_vllm_prompt_logprobs_and_token_ids(served):
    """prompt_logprobs (vLLM's shape: per position the prompt's token and the k most likely, by id) against
    transformers' float64 log-softmax; return_tokens_as_token_ids shows logprobs' tokens as token_id:N."""
    tok = served.tok
    prompt = [random.randrange(3, 1300) for _ in range(random.randint(5, 12))]
    k = random.randint(1, 5)

    async def go(client):
        scored = await client.completions.create(model="demo", prompt=prompt, max_tokens=1, temperature=0,
                                                 echo=True, logprobs=1, extra_body={"prompt_logprobs": k})
        chat = await client.chat.completions.create(model="demo", messages=USER, max_tokens=1,
                                                    extra_body={"prompt_logprobs": 0})
        chunks = [c async for c in await client.chat.completions.create(
            model="demo", messages=USER, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 0})]
        runs = [await client.chat.completions.create(
            model="demo", messages=USER, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": ids}) for ids in (False, True)]
        as_ids = await client.completions.create(model="demo", prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
                                                 echo=True, extra_body={"return_tokens_as_token_ids": True,
                                                                        "ignore_eos": True, "prompt_logprobs": 1})
        return scored, chat, chunks, runs, as_ids

    scored, chat, chunks, (plain, with_ids), as_ids = served.run(go)
    logp = _log_softmax(served.hf, prompt)
    got = scored.choices[0].model_extra["prompt_logprobs"]
    assert len(got) == len(prompt) and got[0] is None
    for pos in range(1, len(prompt)):
        row, entry = logp[pos - 1], got[pos]
        token = str(prompt[pos])
        assert next(iter(entry)) == token and entry[token]["logprob"] == pytest.approx(row[prompt[pos]].item(), abs=2e-4)
        top = row.topk(k)
        ranked = {t: e for t, e in entry.items() if e["rank"] is not None}
        assert sorted((e["rank"], int(t)) for t, e in ranked.items()) == list(enumerate(top.indices.tolist(), 1)) or \
            len(ranked) == k  # a near tie may order two of the k differently
        for t, e in ranked.items():
            assert e["logprob"] == pytest.approx(row[int(t)].item(), abs=2e-4) and e["decoded_token"] == tok.decode([int(t)])
    # echo's own top_logprobs keep their own count (logprobs=1: the top one and the prompt's token).
    assert all(len(top) <= 2 for top in scored.choices[0].logprobs.top_logprobs[1:])
    chat_lp = chat.model_extra["prompt_logprobs"]
    assert len(chat_lp) == chat.usage.prompt_tokens and chat_lp[0] is None and all(len(e) == 1 for e in chat_lp[1:])
    streamed = [c.model_extra["prompt_logprobs"] for c in chunks if (c.model_extra or {}).get("prompt_logprobs")]
    assert len(streamed) == 1 and len(streamed[0]) == len(chat_lp)  # with the first chunk: the same prompt's
    for got_entry, want_entry in zip(streamed[0][1:], chat_lp[1:]):
        assert got_entry.keys() == want_entry.keys()
        assert [e["logprob"] for e in got_entry.values()] == pytest.approx([e["logprob"] for e in want_entry.values()],
                                                                           abs=1e-4)

    shown = [c.token for c in with_ids.choices[0].logprobs.content]
    assert all(re.fullmatch(r"token_id:\d+", t) for t in shown)
    assert [tok.decode([int(t.split(":")[1])]) for t in shown] == [c.token for c in plain.choices[0].logprobs.content]
    assert all(re.fullmatch(r"token_id:\d+", t.token) for c in with_ids.choices[0].logprobs.content for t in c.top_logprobs)
    shown = as_ids.choices[0].logprobs.tokens
    assert all(re.fullmatch(r"token_id:\d+", t) for t in shown) and len(shown) == len(prompt) + 3
    assert [int(t.split(":")[1]) for t in shown[:len(prompt)]] == prompt
    assert as_ids.choices[0].text.startswith("".join(tok.decode([t]) for t in prompt))  # the echo stays text
    assert all(e["decoded_token"].startswith("token_id:") for p in as_ids.choices[0].model_extra["prompt_logprobs"][1:]
               for e in p.values())


def test_vllm_guided_fields(served):
    """guided_regex, guided_choice, guided_json and structured_outputs hold the output to what they say;
    two at once, or a structured_outputs kind this server lacks, are 400s naming the field."""
    regex = "[a-c]{2}x[0-9]"
    options = ["river bank", "mill", '"quoted"', "x|y"]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    asks = [({"guided_regex": regex, "response_format": {"type": "text"}}, lambda t: re.fullmatch(regex, t)),
            ({"guided_choice": options}, lambda t: t in options),
            ({"guided_json": json.dumps(schema)}, lambda t: jsonschema.validate(json.loads(t), schema) is None),
            ({"structured_outputs": {"choice": options}}, lambda t: t in options),
            ({"structured_outputs": {"regex": regex}}, lambda t: re.fullmatch(regex, t)),
            ({"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
             lambda t: jsonschema.validate(json.loads(t), schema) is None)]
    bad = [({"guided_regex": regex, "guided_choice": options}, "guided_choice"),
           ({"guided_regex": "[a-"}, "guided_regex"),
           ({"structured_outputs": {"grammar": "start: 'a'"}}, "structured_outputs.grammar"),
           ({"structured_outputs": {}}, "structured_outputs"),
           ({"guided_json": "{not json"}, "guided_json")]

    async def go(client):
        outs = await asyncio.gather(*(client.chat.completions.create(
            model="demo", messages=USER, max_tokens=40, temperature=1.0, seed=random.randrange(2**31), extra_body=extra)
            for extra, _ in asks for _ in range(2)))
        refusals = []
        for extra, _ in bad:
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(model="demo", messages=USER, max_tokens=4, extra_body=extra)
            refusals.append(refused.value.body["param"])
        return outs, refusals

    outs, refusals = served.run(go)
    for (extra, check), out in zip([a for a in asks for _ in range(2)], outs):
        text = out.choices[0].message.content
        assert out.choices[0].finish_reason == "stop" and check(text), (extra, text)
    assert refusals == [param for _, param in bad]


def test_scoring_only_for_lm_eval(served):
    """lm-eval's loglikelihood bodies (local-completions: token-id prompts, echo, logprobs 1, temperature 0, seed
    1234), with max_tokens 0 (older releases, vLLM accepts it) and 1: the prompt's logprobs against
    transformers'; with 0 nothing is generated or billed but the prompt, streamed or not."""
    prompts = [[random.randrange(3, 1300) for _ in range(random.randint(4, 10))] for _ in range(2)]
    body = {"model": "demo", "prompt": prompts, "temperature": 0, "max_tokens": 0, "logprobs": 1, "seed": 1234,
            "echo": True}
    status, zero = served.post("/v1/completions", body)
    assert status == 200, zero
    status, one = served.post("/v1/completions", {**body, "max_tokens": 1})
    assert status == 200, one
    status, streamed = served.post("/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200, streamed
    total = sum(map(len, prompts))
    assert zero["usage"] == {"prompt_tokens": total, "completion_tokens": 0, "total_tokens": total,
                             "prompt_tokens_details": zero["usage"]["prompt_tokens_details"]}
    assert one["usage"]["completion_tokens"] == 2 and streamed[-1]["usage"]["completion_tokens"] == 0
    for prompt, scored, generated in zip(prompts, zero["choices"], one["choices"]):
        lp = scored["logprobs"]
        logp = _log_softmax(served.hf, prompt)
        echoed = "".join(served.tok.decode([t]) for t in prompt)  # a token-id prompt echoes its tokens' texts
        assert scored["finish_reason"] == "length" and scored["text"] == echoed
        assert len(lp["tokens"]) == len(prompt) and lp["token_logprobs"][0] is None
        want = [logp[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
        assert lp["token_logprobs"][1:] == pytest.approx(want, abs=2e-4)
        # lm-eval's parse: the continuation's logprobs and whether each was the greedy choice.
        assert all(v == pytest.approx(max(top.values())) or v < max(top.values())
                   for v, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]))
        assert generated["logprobs"]["token_logprobs"][:len(prompt)] == pytest.approx(lp["token_logprobs"], abs=1e-5)
        assert len(generated["logprobs"]["tokens"]) == len(prompt) + 1
    chunks = [e for e in streamed if e["choices"]]
    assert sorted("".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i)
                  for i in range(2)) == sorted("".join(served.tok.decode([t]) for t in p) for p in prompts)

    # Only as scoring: max_tokens 0 without echo, or in chat, is refused by name.
    for path, extra in (("/v1/completions", {"echo": False}), ("/v1/chat/completions", {})):
        refused = {"model": "demo", "max_tokens": 0, **extra}
        refused.update({"messages": USER} if "chat" in path else {"prompt": "x"})
        status, answer = served.post(path, refused)
        assert status == 400 and answer["error"]["param"] == "max_tokens", answer


@pytest.mark.parametrize("tool_choice", ["required", "get_weather"])
def test_openai_agents_chat_model_with_output_type_and_forced_tools(served, tool_choice):
    """openai-agents' chat-completions model, unchanged: an agent with an ``output_type`` sends its answer's
    ``response_format`` with every request, the forced ``tool_choice`` on the first (the SDK then resets it to
    auto). The forced call's schema wins over the answer's format (as OpenAI's API does), the tool runs with
    arguments valid for its own schema (checked with `jsonschema`), and the final answer parses as the
    output type."""
    from typing import Literal

    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from pydantic import BaseModel

    set_tracing_disabled(True)  # nothing is sent to OpenAI's trace endpoint
    calls = []

    @function_tool
    def get_weather(city: Literal["Oslo", "Lima"]) -> str:
        """Weather in a city."""
        calls.append(city)
        return "sunny"

    class Forecast(BaseModel):
        city: Literal["Oslo", "Lima"]
        warm: bool

    async def go(client):
        agent = Agent(name="weather", instructions="Answer with the forecast.", tools=[get_weather],
                      output_type=Forecast, model=OpenAIChatCompletionsModel(model="demo", openai_client=client),
                      model_settings=ModelSettings(tool_choice=tool_choice, max_tokens=48,
                                                   extra_body={"seed": random.randrange(2**31)}))
        return await Runner.run(agent, "What is the weather in Oslo?", max_turns=4)

    result = served.run(go)
    assert calls and all(c in ("Oslo", "Lima") for c in calls), calls
    jsonschema.validate({"city": calls[0]}, get_weather.params_json_schema)
    assert isinstance(result.final_output, Forecast), result.final_output


def test_openai_hints_on_chat_as_on_responses(served):
    """The hints the openai client's chat.completions.create sends (prompt_cache_key, prompt_cache_retention,
    safety_identifier, verbosity), as its Responses API takes them: accepted, and the greedy answer is the one
    without them (they change nothing here); a value of the wrong type is a 400 naming the field. The client's
    completions.create sends none of them, so /v1/completions still refuses them as unknown fields."""
    import inspect

    hints = {"prompt_cache_key": f"user-{random.randrange(10**6)}", "prompt_cache_retention": random.choice(
        ["in_memory", "24h"]), "safety_identifier": f"{random.getrandbits(64):016x}",
        "verbosity": random.choice(["low", "medium", "high"])}
    sent_by_chat = inspect.signature(openai.resources.chat.completions.AsyncCompletions.create).parameters
    sent_by_completions = inspect.signature(openai.resources.completions.AsyncCompletions.create).parameters
    assert hints.keys() <= sent_by_chat.keys() and not hints.keys() & sent_by_completions.keys()
    messages = [{"role": "user", "content": _words(5)}]

    async def go(client):
        plain = await client.chat.completions.create(model="demo", messages=messages, max_tokens=6, temperature=0)
        hinted = await client.chat.completions.create(model="demo", messages=messages, max_tokens=6, temperature=0,
                                                      **hints)
        refused = {}
        for field, bad in (("prompt_cache_key", random.randrange(100)), ("safety_identifier", ["x"]),
                           ("verbosity", "loud"), ("prompt_cache_retention", "1h")):
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(model="demo", messages=messages, max_tokens=1,
                                                     extra_body={field: bad})
            refused[field] = err.value.body
        for field, value in hints.items():
            with pytest.raises(openai.BadRequestError) as err:
                await client.completions.create(model="demo", prompt="hi", max_tokens=1, extra_body={field: value})
            refused["completions " + field] = err.value.body
        return plain, hinted, refused

    plain, hinted, refused = served.run(go)
    assert hinted.choices[0].message.content == plain.choices[0].message.content
    assert hinted.usage.prompt_tokens == plain.usage.prompt_tokens
    for field in hints:
        assert refused[field]["param"] == field, refused[field]
        assert refused["completions " + field]["param"] == field and "unknown field" in refused[
            "completions " + field]["message"], refused["completions " + field]

    # A Responses API request runs as the chat request carrying the same hints by the same names (its
    # text.verbosity is chat's verbosity), so whatever the chat path makes of them, both APIs get.
    from gateway.responses.request import decode_request
    from gateway.responses.translate import chat_request

    verbosity = hints.pop("verbosity")
    req, items, tools = decode_request(json.dumps({"input": _words(3), "text": {"verbosity": verbosity},
                                                   **hints}).encode())
    chat = chat_request(req, items, tools)
    assert {field: getattr(chat, field) for field in hints} == hints and chat.verbosity == verbosity


def test_prompt_cache_options_taken_and_moderation_refused(served):
    """``prompt_cache_options`` as the openai client sends it on chat and Responses: its values checked (a bad
    one is a 400 naming ``prompt_cache_options.<field>``), and the greedy answer the one without it (the prefix
    cache is always on here). ``moderation`` asks for checks this server does not run: a 400 naming it that says
    so, on both APIs, rather than an answer that looks moderated; null asks for nothing and is taken. So is the
    Responses API's ``access_programs`` (OpenAI's access tiers), which this server has none of."""
    options = {"mode": random.choice(["implicit", "explicit"]), "ttl": "30m"}
    moderation = {"model": "omni-moderation-latest",
                  "policy": {"input": {"mode": random.choice(["score", "block"])}, "output": {"mode": "block"}}}
    messages = [{"role": "user", "content": _words(5)}]
    bad_options = [({"mode": "always"}, "mode"), ({"ttl": random.choice(["1h", "12h", 30])}, "ttl"),
                   ({"mode": "implicit", "breakpoints": 2}, "breakpoints"), ("30m", None)]
    bad_responses_options = [({"mode": 1}, "mode"), ({"ttl": "24h"}, "ttl"), ({"prewarm": "yes"}, "prewarm"),
                             ({"prewarm": True}, "prewarm"), ({"comparison_response_id": 7}, "comparison_response_id")]

    async def go(client):
        plain = await client.chat.completions.create(model="demo", messages=messages, max_tokens=6, temperature=0)
        cached = await client.chat.completions.create(model="demo", messages=messages, max_tokens=6, temperature=0,
                                                      prompt_cache_options=options, moderation=None)
        text = {"plain": plain.choices[0].message.content, "cached": cached.choices[0].message.content}
        # The Responses API runs the same chat: the same greedy answer, with its own options (ttl 12h, a
        # comparison id) taken too.
        for name, extra in (("responses", {}), ("responses cached", {"prompt_cache_options": {
                **options, "ttl": random.choice(["30m", "12h"]), "comparison_response_id": "resp_x",
                "prewarm": False}, "moderation": None})):
            answer = await client.responses.create(model="demo", input=messages[0]["content"], max_output_tokens=6,
                                                   temperature=0, **extra)
            text[name] = answer.output_text
        refused = {}
        for i, (bad, _) in enumerate(bad_options):
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(model="demo", messages=messages, max_tokens=1,
                                                     extra_body={"prompt_cache_options": bad})
            refused[f"chat {i}"] = err.value.body
        for i, (bad, _) in enumerate(bad_responses_options):
            with pytest.raises(openai.BadRequestError) as err:
                await client.responses.create(model="demo", input="hi", max_output_tokens=1,
                                              extra_body={"prompt_cache_options": bad})
            refused[f"responses {i}"] = err.value.body
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model="demo", messages=messages, max_tokens=1, moderation=moderation)
        refused["chat moderation"] = err.value.body
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(model="demo", input="hi", max_output_tokens=1, moderation=moderation)
        refused["responses moderation"] = err.value.body
        with pytest.raises(openai.BadRequestError) as err:  # OpenAI's gated access to cyber-security abilities
            await client.responses.create(model="demo", input="hi", max_output_tokens=1,
                                          access_programs={"cyber": random.choice(["daybreak_blue", "daybreak_red"])})
        refused["responses access_programs"] = err.value.body
        return text, refused

    text, refused = served.run(go)
    assert text["cached"] == text["plain"] and text["responses cached"] == text["responses"], text
    for where, cases in (("chat", bad_options), ("responses", bad_responses_options)):
        for i, (bad, field) in enumerate(cases):
            body = refused[f"{where} {i}"]
            want = "prompt_cache_options" + (f".{field}" if field else "")
            assert body["param"] == want, (where, bad, body)
    for where, field in (("chat", "moderation"), ("responses", "moderation"), ("responses", "access_programs")):
        body = refused[f"{where} {field}"]
        assert body["param"] == field, body
        assert "not offered by this server" in body["message"] and "remove" in body["message"], body
        assert "unknown field" not in body["message"], body


def test_stream_obfuscation_pads_every_event(served):
    """``stream_options.include_obfuscation`` (the openai client's, chat and Responses): every streamed event's JSON
    is padded by an ``obfuscation`` field of random letters and digits to a multiple of ``PAD_TO`` bytes, so event
    sizes no longer follow the generated text; the text is the same greedy text as without it, which carries no
    such field; the official client reads the padded stream."""
    from gateway.stream_padding import PAD_TO

    n = random.randint(4, 10)
    messages = [{"role": "user", "content": _words(5)}]
    chat = {"model": "demo", "messages": messages, "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True}

    async def raw(path: str, body: dict) -> list[bytes]:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {served.key}"}) as http:
            async with http.post(served.server.make_url(path), json=body) as r:
                assert r.status == 200, await r.text()
                text = await r.read()
        events = [line[len(b"data: "):] for line in text.split(b"\n") if line.startswith(b"data: ")]
        return [e for e in events if e != b"[DONE]"]

    async def go(client):
        padded = await raw("/v1/chat/completions", {**chat, "stream_options": {"include_obfuscation": True}})
        plain = await raw("/v1/chat/completions", chat)
        responses = await raw("/v1/responses", {"model": "demo", "input": _words(4), "max_output_tokens": n,
                                                "stream": True, "stream_options": {"include_obfuscation": True}})
        parsed = [c async for c in await client.chat.completions.create(
            model="demo", messages=messages, max_tokens=n, temperature=0, stream=True,
            stream_options={"include_obfuscation": True}, extra_body={"ignore_eos": True})]
        return padded, plain, responses, parsed

    padded, plain, responses, parsed = served.run(go)
    for events in (padded, responses):
        assert events and all(len(e) % PAD_TO == 0 for e in events), [len(e) for e in events]
        pads = [json.loads(e)["obfuscation"] for e in events]
        assert all(re.fullmatch(r"[A-Za-z0-9]*", p) for p in pads)
    assert all("obfuscation" not in json.loads(e) for e in plain)
    assert len({len(e) for e in plain}) > 1  # unpadded sizes vary (the check above is not vacuous)

    def text(events):
        return "".join(c["delta"].get("content") or "" for e in events for c in json.loads(e)["choices"])

    assert text(padded) == text(plain) == "".join(c.choices[0].delta.content or "" for c in parsed if c.choices)
    assert all(c.obfuscation is not None for c in parsed)


def test_responses_stream_obfuscation_null_asks_for_none(served):
    """On the Responses API ``stream_options.include_obfuscation: null`` (a client's unset option sent as null)
    asks for no padding, as it did before padding was offered: the stream is taken, and no event is padded."""
    n = random.randint(2, 6)

    async def go(client):
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {served.key}"}) as http:
            async with http.post(served.server.make_url("/v1/responses"), json={
                    "model": "demo", "input": _words(4), "max_output_tokens": n, "stream": True,
                    "stream_options": {"include_obfuscation": None}}) as r:
                return r.status, await r.read()

    status, text = served.run(go)
    assert status == 200, text
    events = [json.loads(line[len(b"data: "):]) for line in text.split(b"\n") if line.startswith(b"data: ")]
    assert events and events[-1]["type"] in ("response.completed", "response.incomplete")
    assert all("obfuscation" not in e for e in events)


def _breakpoint() -> dict:
    """A prompt cache breakpoint as the openai client types it: ``mode`` explicit, ``ttl`` given or left out."""
    return {"mode": "explicit", **random.choice([{}, {"ttl": "30m"}, {"ttl": "12h"}])}


def test_prompt_cache_breakpoints_checked_counted_and_stored(served):
    """``prompt_cache_breakpoint`` on content parts (chat's text and image_url parts, the Responses API's
    input_text and input_image parts, the openai client's types): a bad one is a 400 naming its path, a fifth in one
    request is a 400 naming it (OpenAI's limit of four), and the greedy answer is the one without them (the prefix
    cache keeps every block anyway). A stored response's input items keep each breakpoint as sent (and carry none
    where none was sent), and continue through ``previous_response_id`` however many the stored conversation
    holds: the limit is each request's own."""
    first, second = _words(4), _words(3)
    plain_messages = [{"role": "system", "content": [{"type": "text", "text": first}]},
                      {"role": "user", "content": [{"type": "text", "text": second}]}]
    marked = [{"role": m["role"], "content": [{**m["content"][0], "prompt_cache_breakpoint": _breakpoint()}]}
              for m in plain_messages]
    # Five to eight parts with a breakpoint each, among others without: the fifth is the one refused.
    many = random.randint(5, 8)
    parts = [{"type": "text", "text": _words(1)} for _ in range(many + random.randint(0, 3))]
    for j in sorted(random.sample(range(len(parts)), many)):
        parts[j]["prompt_cache_breakpoint"] = _breakpoint()
    fifth = [j for j, p in enumerate(parts) if "prompt_cache_breakpoint" in p][4]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    bad_breakpoints = [({"mode": "implicit"}, ".mode"), ({"mode": "explicit", "ttl": random.choice(["1h", "24h", 30])},
                       ".ttl"), ({"ttl": "30m"}, ".mode"), ({"mode": "explicit", "scope": "x"}, ".scope"),
                       ("explicit", "")]

    async def go(client):
        text = {}
        for name, messages in (("plain", plain_messages), ("marked", marked)):
            reply = await client.chat.completions.create(model="demo", messages=messages, max_tokens=6, temperature=0)
            text[name] = reply.choices[0].message.content
        refused = {}
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model="demo", messages=[{"role": "user", "content": parts}],
                                                 max_tokens=1)
        refused["chat many"] = err.value.body
        for i, (bad, _) in enumerate(bad_breakpoints):
            part = random.choice([{"type": "text", "text": "hi"}, image])
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(model="demo", max_tokens=1, messages=[
                    {"role": "user", "content": [{"type": "text", "text": "a"}, {**part, "prompt_cache_breakpoint": bad}]}])
            refused[f"chat {i}"] = err.value.body
            with pytest.raises(openai.BadRequestError) as err:
                part = random.choice([{"type": "input_text", "text": "hi"},
                                      {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}])
                await client.responses.create(model="demo", max_output_tokens=1, input=[
                    {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                                 {**part, "prompt_cache_breakpoint": bad}]}])
            refused[f"responses {i}"] = err.value.body
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(model="demo", max_output_tokens=1, input=[
                {"role": "user", "content": [{**p, "type": "input_text"} for p in parts]}])
        refused["responses many"] = err.value.body

        # Responses: four breakpoints per request, over a stored conversation that holds more.
        def turn(words: str, marked: bool = True) -> list[dict]:
            return [{"role": "user", "content": [
                {"type": "input_text", "text": w, **({"prompt_cache_breakpoint": _breakpoint()} if marked else {})}
                for w in words.split()]}]

        plain = await client.responses.create(model="demo", input=turn(first, marked=False), max_output_tokens=6,
                                              temperature=0)
        one = await client.responses.create(model="demo", input=turn(first), max_output_tokens=6, temperature=0)
        two = await client.responses.create(model="demo", input=[*turn(_words(4)), {"role": "user", "content": [
            {"type": "input_text", "text": "plain"}]}], previous_response_id=one.id, max_output_tokens=3)
        three = await client.responses.create(model="demo", input=turn(_words(2)), previous_response_id=two.id,
                                              max_output_tokens=3)
        listed = {r.id: [i async for i in client.responses.input_items.list(r.id, order="asc")] for r in (one, two)}
        raw = await client.get(f"/responses/{two.id}/input_items", cast_to=object, options={"params": {"order": "asc"}})
        return text, refused, (plain, one, three), listed, raw

    text, refused, (plain, one, three), listed, raw = served.run(go)
    assert text["marked"] == text["plain"], text
    assert one.output_text == plain.output_text and three.status in ("completed", "incomplete")
    assert refused["chat many"]["param"] == f"messages[0].content[{fifth}].prompt_cache_breakpoint", refused
    assert refused["responses many"]["param"] == f"input[0].content[{fifth}].prompt_cache_breakpoint", refused
    assert "four" in refused["chat many"]["message"] or "4" in refused["chat many"]["message"]
    for i, (bad, field) in enumerate(bad_breakpoints):
        for where, item in (("chat", "messages"), ("responses", "input")):
            body = refused[f"{where} {i}"]
            assert body["param"] == f"{item}[0].content[1].prompt_cache_breakpoint{field}", (where, bad, body)
    # Stored as sent: each breakpoint (ttl left out where it was), no field where none was sent.
    for part in [p for item in listed[one.id] for p in item.content]:
        assert part.prompt_cache_breakpoint is not None and part.prompt_cache_breakpoint.mode == "explicit"
    sent_ttls = [p.prompt_cache_breakpoint.ttl for p in listed[one.id][0].content]
    assert all(t in (None, "30m", "12h") for t in sent_ttls)
    # The second response's items: the first's input (four marked words), its answer, its own input (four marked
    # words and an unmarked part).
    parts_two = [p for item in raw["data"] for p in item["content"]]
    assert [p["type"] == "output_text" or "prompt_cache_breakpoint" in p for p in parts_two] == [True] * 9 + [False]
    assert all("prompt_cache_breakpoint" not in p for p in parts_two if p["type"] == "output_text")


def test_background_and_image_options_checked(served):
    """The Responses API's ``background_options`` and ``image`` as the openai client sends them.
    ``completion_window`` ``soonest`` (and ``continuation_id``, a string of at most 512 characters) runs as
    without them; ``2h`` and ``8h`` need ``background: true`` and no stream (a 400 naming the window otherwise), and
    ``background: true`` is a 400 that points to the Batch API, this server's discounted offline runs.
    ``image.context_compression`` ``auto`` or ``disabled`` is taken and echoed as ``disabled`` (images are read
    whole); ``enabled`` is a 400 saying this server offers none."""
    words = _words(4)
    bad = [({"background_options": {"completion_window": random.choice(["2h", "8h"])}},
            "background_options.completion_window"),
           ({"background_options": {"completion_window": random.choice(["2h", "8h"])}, "stream": True,
             "background": random.choice([True, False])}, "background_options.completion_window"),
           ({"background_options": {"completion_window": "1h"}}, "background_options.completion_window"),
           ({"background_options": {"continuation_id": 7}}, "background_options.continuation_id"),
           ({"background_options": {"continuation_id": "c" * random.randint(513, 2000)}},
            "background_options.continuation_id"),
           ({"background_options": {"priority": "high"}}, "background_options.priority"),
           ({"background_options": {"completion_window": random.choice(["2h", "8h"])}, "background": True},
            "background"),
           ({"background": True}, "background"),
           ({"image": {"context_compression": "enabled"}}, "image.context_compression"),
           ({"image": {"context_compression": "max"}}, "image.context_compression"),
           ({"image": {"detail": "low"}}, "image.detail")]

    async def go(client):
        plain = await client.responses.create(model="demo", input=words, max_output_tokens=6, temperature=0)
        taken = await client.responses.create(
            model="demo", input=words, max_output_tokens=6, temperature=0,
            background_options={"completion_window": random.choice(["soonest", None]) or "soonest",
                                "continuation_id": f"c-{random.randrange(10**9)}"},
            image={"context_compression": random.choice(["auto", "disabled"])})
        refused = []
        for extra, _ in bad:
            with pytest.raises(openai.BadRequestError) as err:
                await client.responses.create(model="demo", input="hi", max_output_tokens=1, **extra)
            refused.append(err.value.body)
        return plain, taken, refused

    plain, taken, refused = served.run(go)
    assert taken.output_text == plain.output_text
    assert taken.image is not None and taken.image.context_compression == "disabled" and plain.image is None
    for (extra, param), body in zip(bad, refused):
        assert body["param"] == param, (extra, body)
    window, background, enabled = refused[0], refused[7], refused[8]
    assert "background: true" in window["message"], window
    assert "/v1/batches" in background["message"], background
    assert "no image context compression" in enabled["message"], enabled
