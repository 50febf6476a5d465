"""The Responses API through the official `openai` client (its pydantic types parse every response and event)
against an in-process server on a fresh random demo model: text and instructions, streamed and whole,
compared with the chat path's greedy output and transformers' rendering of the same turns; forced function
calls whose arguments validate with `jsonschema`, their outputs sent back as input items; `text.format`
json_schema; `previous_response_id` per tenant (stored, another tenant's refused, store false, GET, DELETE);
bad bodies as 400s naming the field."""

import asyncio
import json
import random

import jsonschema
import openai
import pydantic
import pytest
from transformers import AutoTokenizer

from tests.gateway.in_process import in_process_server
from tests.gateway.tenant_keys import new_tenant_key

pytestmark = pytest.mark.timeout(300)

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather forecast", "parameters": WEATHER,
          "strict": True}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(event loop, base url, {tenant: key}, checkpoint dir, database url) of one in-process server on a fresh
    demo model; tenant "limited" may send one request a minute."""
    with in_process_server(tmp_path_factory.mktemp("responses"), dict(
            num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=512, max_model_len=1024)) as srv:
        keys = {name: srv.run(new_tenant_key(srv.database_url, name)) for name in ("a", "b")}
        keys["limited"] = srv.run(new_tenant_key(srv.database_url, "limited", requests_per_minute=1))
        yield srv.loop, srv.base_url, keys, srv.demo, srv.database_url


def _run(served, scenario, tenant="a"):
    loop, base_url, keys, *_ = served

    async def with_client():
        client = openai.AsyncOpenAI(base_url=base_url, api_key=keys[tenant], max_retries=0, timeout=120)
        try:
            return await scenario(client)
        finally:
            await client.close()

    return loop.run_until_complete(with_client())


def _prompt_tokens(served, messages, **kwargs) -> int:
    tokenizer = AutoTokenizer.from_pretrained(served[3])
    return len(tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                              **kwargs)))


def test_text_with_instructions_matches_chat_streamed_and_whole(served):
    words = " ".join(random.sample(["red", "blue", "stone", "river", "cloud", "seven", "glass"], 4))
    max_tokens = random.randint(6, 12)

    async def scenario(client):
        whole = await client.responses.create(model="demo", instructions="Answer briefly.", input=words,
                                              max_output_tokens=max_tokens, temperature=0, metadata={"run": "1"})
        chat = await client.chat.completions.create(
            model="demo", messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": words}],
            max_tokens=max_tokens, temperature=0)
        events = [e async for e in await client.responses.create(
            model="demo", instructions="Answer briefly.", input=[{"role": "user", "content": words}],
            max_output_tokens=max_tokens, temperature=0, stream=True)]
        async with client.responses.stream(model="demo", instructions="Answer briefly.", max_output_tokens=max_tokens,
                                           input=[{"type": "message", "role": "user",
                                                   "content": [{"type": "input_text", "text": words}]}],
                                           temperature=0) as helper:
            # The helper's last event: response.completed, or response.incomplete when cut at max_output_tokens
            # (get_final_response() takes only the former, as with OpenAI's own server).
            helped = [e async for e in helper][-1].response
        return whole, chat, events, helped

    whole, chat, events, helped = _run(served, scenario)
    expected = chat.choices[0].message.content
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.model == "demo"
    assert whole.output_text == expected and helped.output_text == expected, (whole.output_text, expected)
    assert whole.instructions == "Answer briefly." and whole.metadata == {"run": "1"}
    message = [item for item in whole.output if item.type == "message"]
    assert len(message) == 1 and message[0].role == "assistant" and message[0].content[0].type == "output_text"
    if chat.choices[0].finish_reason == "length":
        assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    else:
        assert whole.status == "completed" and whole.incomplete_details is None
    usage = whole.usage
    assert usage.input_tokens == chat.usage.prompt_tokens == _prompt_tokens(
        served, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": words}])
    assert usage.output_tokens == chat.usage.completion_tokens and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0 and usage.input_tokens_details.cached_tokens >= 0

    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], kinds
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"], kinds
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
    final = events[-1].response
    assert final.output_text == expected and final.status == whole.status
    assert (final.usage.input_tokens, final.usage.output_tokens) == (usage.input_tokens, usage.output_tokens)
    assert final.usage.input_tokens_details.cached_tokens > 0  # the same prompt again: its blocks were cached
    assert events[0].response.status == "in_progress" and events[0].response.output == []


def test_forced_call_then_its_output_as_input_items(served):
    async def scenario(client):
        first = await client.responses.create(
            model="demo", input="Weather in Paris for three days?", tools=TOOLS, temperature=0,
            tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=120)
        calls = [item for item in first.output if item.type == "function_call"]
        results = [{"type": "function_call_output", "call_id": c.call_id, "output": json.dumps({"sky": "clear"})}
                   for c in calls]
        history = [{"role": "user", "content": "Weather in Paris for three days?"},
                   *[c.model_dump(exclude_none=True) for c in first.output], *results]
        follow = await client.responses.create(model="demo", input=history, tools=TOOLS, tool_choice="none",
                                               max_output_tokens=6, temperature=0)
        # The same turn continued from the stored response: only the outputs are sent.
        chained = await client.responses.create(model="demo", input=results, previous_response_id=first.id,
                                                tools=TOOLS, tool_choice="none", max_output_tokens=6, temperature=0)
        events = [e async for e in await client.responses.create(
            model="demo", input="Weather in Oslo?", tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            max_output_tokens=120, temperature=0, stream=True)]
        return first, calls, follow, chained, events

    first, calls, follow, chained, events = _run(served, scenario)
    assert first.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    arguments = json.loads(calls[0].arguments)
    jsonschema.validate(arguments, WEATHER)
    assert follow.output_text is not None and not [i for i in follow.output if i.type == "function_call"]
    # The call and its output reached the chat template: the prompt is the one transformers renders.
    rendered = [{"role": "user", "content": "Weather in Paris for three days?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0].call_id, "type": "function",
                                                                         "function": {"name": "get_weather",
                                                                                      "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": calls[0].call_id, "content": json.dumps({"sky": "clear"})}]
    assert follow.usage.input_tokens == _prompt_tokens(served, rendered)  # tool_choice none: tools not rendered
    assert (chained.output_text, chained.usage.input_tokens) == (follow.output_text, follow.usage.input_tokens)

    kinds = [e.type for e in events]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and kinds[-1] == "response.completed", kinds
    jsonschema.validate(json.loads(done[0].arguments), WEATHER)
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == done[0].arguments
    item = events[-1].response.output[-1]
    assert item.type == "function_call" and item.arguments == done[0].arguments and item.status == "completed"


class Reading(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=6)
    ok: bool
    level: int = pydantic.Field(ge=0, le=9)


def test_text_format_json_schema(served):
    async def scenario(client):
        return await asyncio.gather(*(client.responses.parse(
            model="demo", input=f"reading {i}", text_format=Reading, max_output_tokens=80, temperature=1.0)
            for i in range(4)))

    for parsed in _run(served, scenario):
        assert parsed.status == "completed"
        assert isinstance(parsed.output_parsed, Reading)
        jsonschema.validate(json.loads(parsed.output_text), Reading.model_json_schema())
        assert parsed.text.format.type == "json_schema" and parsed.text.format.name == "Reading"


def test_previous_response_id_per_tenant(served):
    async def scenario(client):
        first = await client.responses.create(model="demo", input="Name a colour.", instructions="Be terse.",
                                              max_output_tokens=5, temperature=0)
        second = await client.responses.create(model="demo", input="And another?", previous_response_id=first.id,
                                               max_output_tokens=5, temperature=0)
        fetched = await client.responses.retrieve(second.id)
        listed = [item async for item in client.responses.input_items.list(second.id, order="asc")]
        newest = await client.responses.input_items.list(second.id, limit=1)
        # The same conversation as chat messages: the stored output is replayed as text (an added token it spells,
        # "<tool_response>", stays text, as in any client string), so transformers' tokenizer alone would count
        # it as one token; the chat path's count, which test_control_tokens checks against transformers, is the
        # reference.
        as_chat = await client.chat.completions.create(model="demo", max_tokens=1, messages=[
            {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And another?"}])
        unstored = await client.responses.create(model="demo", input="hi", store=False, max_output_tokens=2)
        with pytest.raises(openai.NotFoundError) as missing:
            await client.responses.create(model="demo", input="x", previous_response_id=unstored.id)
        return first, second, fetched, missing.value, listed, newest, as_chat

    first, second, fetched, missing, listed, newest, as_chat = _run(served, scenario)
    assert second.previous_response_id == first.id and fetched == second
    assert missing.body["param"] == "previous_response_id"
    # Its input items: the first turn (its output included) and the new input, as the openai types read them.
    assert [(i.type, i.role, i.content[0].text) for i in listed] == [
        ("message", "user", "Name a colour."), ("message", "assistant", first.output_text),
        ("message", "user", "And another?")]
    assert listed[1].id == first.output[0].id and len({i.id for i in listed}) == 3
    assert newest.has_more and [i.id for i in newest.data] == [listed[-1].id]  # newest first by default
    # The follow-up's prompt is the whole conversation, without the first request's instructions (as OpenAI does).
    assert second.usage.input_tokens == as_chat.usage.prompt_tokens
    if not any(t in first.output_text for t in ("<think>", "<tool_call>", "<tool_response>", "</")):
        assert second.usage.input_tokens == _prompt_tokens(served, [
            {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And another?"}])

    async def other_tenant(client):
        with pytest.raises(openai.NotFoundError) as stolen:
            await client.responses.create(model="demo", input="x", previous_response_id=first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)
        return stolen.value

    assert _run(served, other_tenant, tenant="b").body["param"] == "previous_response_id"

    async def delete(client):
        await client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.delete(first.id)
        return (await client.responses.retrieve(second.id)).id  # the follow-up keeps its own conversation

    assert _run(served, delete) == second.id


def test_whole_number_float_keeps_the_stored_conversation_and_its_checks(served):
    """``max_output_tokens`` written as a whole-number float (``5.0``) is taken for the integer everywhere in the
    body, so it must be in the route's first look at the body too: the stored conversation named by
    ``previous_response_id`` is read (the prompt holds it, as with ``5``), another tenant's id stays a 404, and the
    stored-response cap is checked as usual."""
    n = random.randint(2, 6)

    async def scenario(client):
        first = await client.responses.create(model="demo", input="Name a colour.", max_output_tokens=n,
                                              temperature=0)
        as_int = await client.responses.create(model="demo", input="And another?", previous_response_id=first.id,
                                               max_output_tokens=n, temperature=0)
        as_float = await client.responses.create(model="demo", input="And another?", previous_response_id=first.id,
                                                 max_output_tokens=float(n), temperature=0)
        return first, as_int, as_float

    first, as_int, as_float = _run(served, scenario)
    assert as_float.previous_response_id == first.id
    assert as_float.usage.input_tokens == as_int.usage.input_tokens  # the conversation was read, not dropped
    assert [o.content[0].text for o in as_float.output] == [o.content[0].text for o in as_int.output]

    async def other_tenant(client):
        with pytest.raises(openai.NotFoundError) as stolen:
            await client.responses.create(model="demo", input="x", previous_response_id=first.id,
                                          max_output_tokens=float(n))
        return stolen.value

    assert _run(served, other_tenant, tenant="b").body["param"] == "previous_response_id"


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "temprature": 1}, "temprature"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": "a", "colour": 1}]}, "input[0].colour"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include[0]"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{", "caller": {"type": "x"}}]},
     "input[0].caller.type"),
    ({"input": "hi", "top_k": -2}, "top_k"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "e" * (2**20 + 1)}]},
     "input[0].encrypted_content"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "x-bad": {"$ref": "#/nope"}, "properties": {"a": {"$ref": "#/nope"}}}}}}, "text.format"),
    ({"input": []}, "input"),
    # A message needs at least one content part (or a string), as a chat message does.
    ({"input": [{"role": "user", "content": []}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": "a"}, {"type": "message", "role": "assistant", "content": []}]},
     "input[1].content"),
    # OpenAI's hints are typed as on chat: a value of another type is refused by name.
    ({"input": "hi", "prompt_cache_key": 7}, "prompt_cache_key"),
    ({"input": "hi", "safety_identifier": {"id": "x"}}, "safety_identifier"),
    ({"input": "hi", "text": {"verbosity": "loud"}}, "text.verbosity"),
    # prompt_cache_options as the client types it (the prefix cache is always on: prewarm alone is refused);
    # safety controls this server cannot honour, by name.
    ({"input": "hi", "prompt_cache_options": {"mode": "off"}}, "prompt_cache_options.mode"),
    ({"input": "hi", "prompt_cache_options": {"ttl": "1d"}}, "prompt_cache_options.ttl"),
    ({"input": "hi", "prompt_cache_options": {"prewarm": True}}, "prompt_cache_options.prewarm"),
    ({"input": "hi", "moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ({"input": "hi", "access_programs": {"cyber": "standard"}}, "access_programs"),
    # Past its bound, with or without a conversation to continue: named, not counted against the stored-response
    # cap (whose refusal would name store); an empty previous_response_id is refused, not looked up.
    ({"input": "hi", "max_output_tokens": random.randrange(2**31, 2**63)}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": random.randrange(2**31, 2**63), "previous_response_id": "resp_x"},
     "max_output_tokens"),
    ({"input": "hi", "previous_response_id": ""}, "previous_response_id"),
])
def test_bad_bodies_are_400_naming_the_field(served, body, param):
    async def scenario(client):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.post("/responses", body={"model": "demo", **body}, cast_to=object)
        return refused.value

    err = _run(served, scenario)
    assert err.status_code == 400 and err.body["param"] == param, err.body


def test_openai_agents_run_calls_a_tool_and_answers(served):
    """openai-agents' own Responses model class (its request bodies, its parsing of our output and events): a
    forced tool call runs the tool, whose output goes back as a function_call_output item for the answer."""
    from typing import Annotated, Literal

    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)  # traces would go to OpenAI's servers
    calls = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo", "Lima"], days: Annotated[int, pydantic.Field(ge=1, le=7)]) -> str:
        """Weather forecast for a city."""
        calls.append((city, days))
        return f"clear in {city} for {days} days"

    class Forecast(pydantic.BaseModel):  # the answer's format (text.format json_schema): it ends, so completes
        sky: Literal["clear", "rain"]
        days: Annotated[int, pydantic.Field(ge=1, le=7)]

    async def scenario(client):
        agent = Agent(name="forecaster", instructions="Use the tool, then answer.", tools=[get_weather],
                      output_type=Forecast,
                      model=OpenAIResponsesModel(model="demo", openai_client=client),
                      model_settings=ModelSettings(tool_choice="required", max_tokens=60, temperature=0,
                                                   parallel_tool_calls=False))  # one call: the array has no bound
        whole = await Runner.run(agent, "Weather in Paris for three days?", max_turns=4)
        streamed = Runner.run_streamed(agent, "Weather in Oslo?", max_turns=4)
        kinds = [event.type async for event in streamed.stream_events()]
        return whole, streamed, kinds

    whole, streamed, kinds = _run(served, scenario)
    assert len(calls) == 2, calls  # one forced call per run; the choice is reset to auto after it, as agents do
    for result in (whole, streamed):
        items = [item.type for item in result.new_items]
        assert items[:2] == ["tool_call_item", "tool_call_output_item"] and items[-1] == "message_output_item", items
        assert isinstance(result.final_output, Forecast)
        assert len(result.raw_responses) == 2 and all(r.usage.input_tokens > 0 for r in result.raw_responses)
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds


def test_batch_lines_for_responses(served):
    """/v1/responses lines in the Batch API: each output body is a response object (parsed by the openai types)
    with the live route's greedy text; a line with previous_response_id fails validation, naming it."""
    import io

    from openai.types.responses import Response

    inputs = [f"line {i} {random.choice(['sun', 'moon', 'tide'])}" for i in range(3)]
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses",
              "body": {"model": "demo", "input": text, "instructions": "Be terse.", "max_output_tokens": 6,
                       "temperature": 0}} for i, text in enumerate(inputs)]

    async def scenario(client):
        live = [await client.responses.create(**line["body"]) for line in lines]
        upload = await client.files.create(file=("in.jsonl", io.BytesIO("\n".join(json.dumps(x) for x in lines)
                                                                        .encode())), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/responses", completion_window="24h")
        for _ in range(600):
            batch = await client.batches.retrieve(batch.id)
            if batch.status in ("completed", "failed", "expired", "cancelled"):
                break
            await asyncio.sleep(0.1)
        output = (await client.files.content(batch.output_file_id)).text if batch.output_file_id else ""
        bad = dict(lines[0], body={**lines[0]["body"], "previous_response_id": live[0].id})
        upload = await client.files.create(file=("bad.jsonl", io.BytesIO(json.dumps(bad).encode())), purpose="batch")
        refused = await client.batches.create(input_file_id=upload.id, endpoint="/v1/responses", completion_window="24h")
        return live, batch, output, refused

    live, batch, output, refused = _run(served, scenario)
    assert batch.status == "completed" and batch.request_counts.completed == 3, batch
    results = {r["custom_id"]: r["response"] for r in map(json.loads, output.splitlines())}
    for i, expected in enumerate(live):
        assert results[f"r{i}"]["status_code"] == 200
        body = Response.model_validate(results[f"r{i}"]["body"])
        assert body.output_text == expected.output_text and body.status == expected.status
        assert body.usage.input_tokens == expected.usage.input_tokens and body.store is False
    assert refused.status == "failed" and refused.errors.data[0].param == "body.previous_response_id", refused.errors


def test_quota_and_billing_as_for_chat(served):
    """A tenant's request limit refuses a second response (429); the first is billed under its resp_ id."""
    from sqlalchemy import select

    from tenants.models import Usage
    from tenants.store import TenantStore

    async def scenario(client):
        first = await client.responses.create(model="demo", input="one", max_output_tokens=3)
        with pytest.raises(openai.RateLimitError):
            await client.responses.create(model="demo", input="two", max_output_tokens=3)
        store = TenantStore.open(served[4])
        try:
            for _ in range(200):  # the ledger writes in batches, shortly after the request
                async with store.sessions() as s:
                    rows = (await s.execute(select(Usage).where(Usage.request_id == first.id))).scalars().all()
                if rows:
                    break
                await asyncio.sleep(0.05)
        finally:
            await store.close()
        return first, rows

    first, rows = _run(served, scenario, tenant="limited")
    assert len(rows) == 1 and rows[0].http_status == 200
    assert (rows[0].prompt_tokens, rows[0].completion_tokens) == (first.usage.input_tokens, first.usage.output_tokens)


def test_vllm_sampling_fields_as_guidellm_sends_them(served):
    """GuideLLM's Responses body (its `ResponsesRequestHandler.format`: streamed, `max_output_tokens`, `stop: null`,
    `ignore_eos: true`, input_text parts) runs and produces exactly the tokens asked for; `seed`, `top_k`,
    `min_tokens`, `stop` and the penalties sample as the same fields do on chat."""
    import httpx

    loop, base_url, keys, *_ = served
    words = " ".join(random.sample(["red", "blue", "stone", "river", "cloud", "seven", "glass"], 3))
    wanted = random.randint(12, 20)
    guidellm = {"model": "demo", "stream": True, "max_output_tokens": wanted, "stop": None, "ignore_eos": True,
                "instructions": "prefix words", "input": [{"role": "user", "content": [{"type": "input_text",
                                                                                    "text": words}]}]}

    async def raw_stream():
        async with httpx.AsyncClient(base_url=base_url, timeout=120,
                                     headers={"Authorization": f"Bearer {keys['a']}"}) as http:
            async with http.stream("POST", "/responses", json=guidellm) as reply:
                assert reply.status_code == 200, await reply.aread()
                return [json.loads(line[6:]) async for line in reply.aiter_lines() if line.startswith("data: ")]

    events = loop.run_until_complete(raw_stream())
    last = events[-1]["response"]
    assert last["usage"]["output_tokens"] == wanted, last["usage"]  # ignore_eos: never ends before the limit
    assert last["status"] == "incomplete" and last["incomplete_details"] == {"reason": "max_output_tokens"}

    fields = {"seed": random.randrange(2**31), "top_k": random.randint(2, 8), "min_tokens": 6, "stop": ["\n\n"],
              "presence_penalty": 0.5, "repetition_penalty": 1.1, "min_p": 0.05}

    async def scenario(client):
        responses = [await client.responses.create(model="demo", input=words, max_output_tokens=10, temperature=1.0,
                                                   extra_body=fields) for _ in range(2)]
        chat = await client.chat.completions.create(model="demo", messages=[{"role": "user", "content": words}],
                                                    max_tokens=10, temperature=1.0, extra_body=fields)
        return responses, chat

    responses, chat = _run(served, scenario)
    assert responses[0].output_text == responses[1].output_text == chat.choices[0].message.content  # one seed
    assert responses[0].usage.output_tokens == chat.usage.completion_tokens >= 6  # min_tokens held
    assert "\n\n" not in responses[0].output_text


def test_function_call_cut_by_the_limit_is_incomplete_and_goes_back(served):
    """A forced call cut at max_output_tokens is an `incomplete` item of an `incomplete` response, streamed and
    whole; its truncated arguments sent back (the SDK's own output objects, and their model_dump() with the SDK's
    null fields `namespace`, `caller`, `async`) are taken, as on chat, and rendered as the text they are."""
    cut_at = random.randint(3, 6)

    async def scenario(client):
        whole = await client.responses.create(model="demo", input="Weather in Paris?", tools=TOOLS, temperature=0,
                                              tool_choice={"type": "function", "name": "get_weather"},
                                              max_output_tokens=cut_at)
        events = [e async for e in await client.responses.create(
            model="demo", input="Weather in Paris?", tools=TOOLS, temperature=0, stream=True,
            tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=cut_at)]
        call = whole.output[-1]
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "unknown"}
        backs = []
        for history in ([*whole.output, result], [*(i.model_dump() for i in whole.output), result],
                        [*(i.model_dump(by_alias=True) for i in whole.output), result]):
            backs.append(await client.responses.create(
                model="demo", input=[{"role": "user", "content": "Weather in Paris?"}, *history], max_output_tokens=2,
                temperature=0))
        chat_cut = await client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Weather in Paris?"}], temperature=0,
            tools=[{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=cut_at)
        message = chat_cut.choices[0].message
        chat_back = await client.chat.completions.create(
            model="demo", max_tokens=2, temperature=0,
            messages=[{"role": "user", "content": "Weather in Paris?"}, message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "unknown"}])
        return whole, events, backs, chat_cut, chat_back

    whole, events, backs, chat_cut, chat_back = _run(served, scenario)
    call = whole.output[-1]
    assert whole.status == "incomplete" and call.type == "function_call" and call.status == "incomplete", whole
    with pytest.raises(ValueError):
        json.loads(call.arguments)  # cut: not a whole JSON object
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert events[-1].type == "response.incomplete" and done[-1].status == "incomplete"
    assert events[-1].response.output[-1].status == "incomplete"
    assert chat_cut.choices[0].finish_reason == "length"
    arguments = chat_cut.choices[0].message.tool_calls[0].function.arguments
    assert arguments == call.arguments  # the same greedy text on both routes
    rendered = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                                                                         "function": {"name": "get_weather",
                                                                                      "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "unknown"}]
    expected = _prompt_tokens(served, rendered)
    assert [b.usage.input_tokens for b in backs] == [expected] * 3
    assert chat_back.usage.prompt_tokens == expected
