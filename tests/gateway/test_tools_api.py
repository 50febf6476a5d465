"""Tool calling through the official `openai` client against a real `moegate serve` on the demo model: a
forced call (named, required) -> the tool's result -> a final answer, streamed and not; arguments checked
with `jsonschema` against the tool's own schema; chat-template options checked against transformers'
rendering; bad tool requests are 400s naming the field."""

import json
import random

import jsonschema
import openai
import pytest

from tests.gateway.serve_process import demo_server

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima", "Kyoto"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "JST"]}, "24h": {"type": "boolean"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "system", "content": "You answer with tools."},
            {"role": "user", "content": "What is the weather in Paris for three days?"}]


@pytest.fixture(scope="module")
def served():
    """A real `moegate serve` on the demo model; yields (client, model directory, base URL, key)."""
    with demo_server("moegate-tools-", "--max-model-len", "4096", "--cpu-threads", "1") as (url, key, model, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
        yield client, model, f"{url}/v1", key
        client.close()


def _check_calls(calls, names=None) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _history(calls) -> list[dict]:
    """The assistant's calls and a tool result for each, as an agent sends them back."""
    turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
        for c in calls]}
    results = [{"role": "tool", "tool_call_id": c.id,
                "content": [{"type": "text", "text": json.dumps({"result": "sunny", "for": c.function.name})}]}
               for c in calls]
    return [turn, *results]


@pytest.mark.timeout(300)
def test_round_trip_not_streamed(served):
    client, *_ = served
    seed = random.randrange(2**31)
    first = client.chat.completions.create(
        model="demo", messages=QUESTION, tools=TOOLS, seed=seed, max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    _check_calls(choice.message.tool_calls, {"get_weather"})
    assert len(choice.message.tool_calls) == 1

    required = client.chat.completions.create(model="demo", messages=QUESTION, tools=TOOLS, seed=seed + 1,
                                              max_tokens=200, tool_choice="required", parallel_tool_calls=False)
    assert required.choices[0].finish_reason == "tool_calls"
    _check_calls(required.choices[0].message.tool_calls, set(SCHEMAS))
    assert len(required.choices[0].message.tool_calls) == 1

    history = QUESTION + _history(choice.message.tool_calls)
    final = client.chat.completions.create(model="demo", messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=8, seed=seed)
    answer = final.choices[0]
    assert answer.message.tool_calls is None and isinstance(answer.message.content, str)
    assert answer.finish_reason in ("stop", "length")
    # The history reached the template: the prompt is the one transformers renders (calls and the result in it).
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(served[1])
    rendered = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                        "arguments": json.loads(c.function.arguments)}}
        for c in choice.message.tool_calls]}] + [
        {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"result": "sunny", "for": c.function.name})}
        for c in choice.message.tool_calls]
    text = tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>" in text and final.usage.prompt_tokens == len(tokenizer.encode(text))


@pytest.mark.timeout(300)
def test_round_trip_streamed(served):
    client, *_ = served
    seed = random.randrange(2**31)
    # One call: with parallel calls the random model may add calls until max_tokens (the array has no bound).
    stream = client.chat.completions.create(model="demo", messages=QUESTION, tools=TOOLS, seed=seed, max_tokens=300,
                                            tool_choice="required", parallel_tool_calls=False, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    roles = []  # each chunk's delta.role: OpenAI sends it in the first chunk only
    for chunk in stream:
        c = chunk.choices[0]
        finish = c.finish_reason or finish
        roles.append(c.delta.role)
        for d in c.delta.tool_calls or []:
            if d.index not in calls:  # the first delta of a call: its id, type and name, arguments empty
                assert d.id.startswith("call_") and d.type == "function" and d.function.name in SCHEMAS
                assert d.function.arguments == ""
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.id is None and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments
        assert not c.delta.content
    assert finish == "tool_calls" and sorted(calls) == list(range(len(calls))) and calls
    assert roles[0] == "assistant" and not any(roles[1:]), roles
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])

    # The SDK's stream helper adds the deltas up into one message, as a non-streamed reply would be.
    with client.chat.completions.stream(model="demo", messages=QUESTION, tools=TOOLS, seed=seed, max_tokens=300,
                                        tool_choice="required", parallel_tool_calls=False) as helper:
        message = helper.get_final_completion().choices[0].message
    assert message.role == "assistant" and message.content is None, message
    _check_calls(message.tool_calls, set(SCHEMAS))

    history = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls.values()]},
        *({"role": "tool", "tool_call_id": c["id"], "content": "22 degrees"} for c in calls.values())]
    text, finish, roles = "", None, []
    for chunk in client.chat.completions.create(model="demo", messages=history, tools=TOOLS, tool_choice="auto",
                                                max_tokens=8, seed=seed, stream=True, n=2):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
            roles.append((c.index, c.delta.role))
    assert finish in ("stop", "length", "tool_calls")
    first: dict[int, str | None] = {}
    for i, role in roles:
        first.setdefault(i, role)
    assert first == {0: "assistant", 1: "assistant"} and sum(map(bool, (r for _, r in roles))) == 2, roles


@pytest.mark.timeout(120)
def test_chat_template_options_match_transformers(served):
    client, model, *_ = served
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    words = " ".join(random.choice(["river", "bread", "lamp", "mill"]) for _ in range(5))
    messages = [{"role": "user", "content": words}]
    for kwargs, extra in [({"enable_thinking": False}, {"chat_template_kwargs": {"enable_thinking": False}}),
                          ({}, {})]:
        r = client.chat.completions.create(model="demo", messages=messages, max_tokens=1, extra_body=extra)
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        assert r.usage.prompt_tokens == len(tokenizer.encode(text)), (kwargs, text)
    partial = messages + [{"role": "assistant", "content": "The " + words.split()[0]}]
    r = client.chat.completions.create(model="demo", messages=partial, max_tokens=1,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    text = tokenizer.apply_chat_template(partial, tokenize=False, continue_final_message=True)
    assert text.endswith(partial[-1]["content"]) and r.usage.prompt_tokens == len(tokenizer.encode(text))


@pytest.mark.timeout(120)
def test_bad_tool_requests_name_the_field(served):
    client, *_ = served
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": 1}"}}
    cases = [
        (dict(messages=QUESTION, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
         "tool_choice"),
        (dict(messages=QUESTION, tool_choice="required"), "tool_choice"),
        (dict(messages=[*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "content": "x"}], tools=TOOLS), "messages[3].tool_call_id"),
        (dict(messages=[*QUESTION, {"role": "assistant", "content": None}]), "messages[2].content"),
        (dict(messages=QUESTION, extra_body={"continue_final_message": True, "add_generation_prompt": True}),
         "continue_final_message"),
        (dict(messages=QUESTION, extra_body={"chat_template_kwargs": {"tools": []}}), "chat_template_kwargs"),
        (dict(messages=QUESTION, tools=[{"type": "function", "function": {"name": "bad name!"}}]),
         "tools[0].function.name"),
        (dict(messages=QUESTION, tool_choice="required", tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}]), "tools"),
        (dict(messages=QUESTION, tools=TOOLS, tool_choice="required", extra_body={"guided_json": {"type": "object"}}),
         "guided_json"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="demo", max_tokens=2, **kwargs)
        assert refused.value.body["param"] == param, (kwargs, refused.value.body)


@pytest.mark.timeout(120)
def test_langchain_bind_tools(served):
    """A real framework as the client: LangChain's ChatOpenAI with bind_tools, forcing a call."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    _, _, base_url, key = served
    llm = ChatOpenAI(model="demo", base_url=base_url, api_key=key, max_tokens=120, max_retries=0,
                     seed=random.randrange(2**31))
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                                "parameters": WEATHER}}
    message = llm.bind_tools([weather], tool_choice="get_weather").invoke([HumanMessage("Weather in Oslo?")])
    assert len(message.tool_calls) == 1 and message.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(message.tool_calls[0]["args"], WEATHER)
    # The agent's next step: the call and its result sent back in LangChain's own message types.
    final = llm.bind_tools([weather], tool_choice="none").invoke(
        [HumanMessage("Weather in Oslo?"), message,
         ToolMessage(content="8 degrees", tool_call_id=message.tool_calls[0]["id"])])
    assert isinstance(final.content, str) and not final.tool_calls


@pytest.mark.timeout(120)
def test_langchain_structured_output(served):
    """LangChain's with_structured_output(PydanticModel): the reply comes back as a validated object."""
    from typing import Literal

    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Forecast(BaseModel):
        city: Literal["Paris", "Oslo", "Lima"]
        days: int = Field(ge=1, le=7)
        sunny: bool

    _, _, base_url, key = served
    for seed in random.sample(range(2**31), 3):
        llm = ChatOpenAI(model="demo", base_url=base_url, api_key=key, max_tokens=60, max_retries=0, seed=seed)
        forecast = llm.with_structured_output(Forecast).invoke("Forecast for Lima?")
        assert isinstance(forecast, Forecast)
        jsonschema.validate(forecast.model_dump(), Forecast.model_json_schema())
