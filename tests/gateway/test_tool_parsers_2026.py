"""Tool-call parsers of the 2026 families: Qwen3-Coder / Qwen3.5 XML calls, DeepSeek-V3.2's DSML, Kimi-K2 /
Kimi-Linear's sections; on text written as each family's template writes it with random argument values, whole
and streamed at random split points (the deltas joined give the whole result); malformed markup and calls to
functions not offered stay text; ``auto`` per template and architecture. One end-to-end check through the
official ``openai`` client against an in-process gateway whose demo checkpoint has a Qwen3.5-style template."""

import json
import random
import string

import openai
import pytest

from gateway.tool_parsers import (
    DeepSeekV32ToolParser, KimiK2ToolParser, Qwen3CoderToolParser, detect_tool_parser,
)

TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "zip": {"type": "string"}, "days": {"type": "integer"}, "ratio": {"type": "number"},
    "exact": {"type": "boolean"}, "filters": {"type": "object"}, "tags": {"type": "array"}}}}}
    for name in ("get_weather", "search")]


def _text(rng: random.Random) -> str:
    """A random string, with markup-like characters and values that would read as JSON if not kept as strings."""
    special = ["007", "true", "null", "3.5", "a < b", "x\ny", "Zürich", '"quoted"', "{}", " padded "]
    if rng.random() < 0.4:
        return rng.choice(special)
    return "".join(rng.choice(string.ascii_letters + " <>=/.,\n") for _ in range(rng.randint(1, 12)))


def _random_call(rng: random.Random) -> tuple[str, dict]:
    values = {"city": _text(rng), "zip": _text(rng), "days": rng.randint(-5, 10**6), "ratio": rng.uniform(-1e3, 1e3),
              "exact": rng.random() < 0.5, "filters": {"q": _text(rng), "n": [rng.randint(0, 9)] * rng.randint(0, 3)},
              "tags": [_text(rng) for _ in range(rng.randint(0, 3))]}
    keys = rng.sample(sorted(values), rng.randint(0, len(values)))
    return rng.choice(["get_weather", "search"]), {k: values[k] for k in keys}


def _streamed(parser, text: str, rng: random.Random):
    """``text`` fed in pieces cut at random points; the deltas joined."""
    cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(1, min(len(text) - 1, 40))))
    out = parser.feed(text[:cuts[0]])
    for a, b in zip(cuts, [*cuts[1:], len(text)]):
        out += parser.feed(text[a:b])
    out += parser.finish()
    return out


def _calls(parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def _qwen3_coder(rng: random.Random, calls) -> str:
    """As Qwen3-Coder's / Qwen3.5's template writes calls: strings as they are, objects and arrays as JSON, other
    values through Jinja's string filter (booleans as True / False) or as JSON."""
    def value(v):
        if isinstance(v, str):
            return v
        if isinstance(v, bool) and rng.random() < 0.5:
            return str(v)
        return json.dumps(v, ensure_ascii=rng.random() < 0.5)
    return "\n".join("<tool_call>\n<function=" + name + ">\n" + "".join(
        f"<parameter={k}>\n{value(v)}\n</parameter>\n" for k, v in args.items()) + "</function>\n</tool_call>"
        for name, args in calls)


def _dsml(rng: random.Random, calls) -> str:
    def param(k, v):
        if isinstance(v, str):
            return f'<｜DSML｜parameter name="{k}" string="true">{v}</｜DSML｜parameter>\n'
        return f'<｜DSML｜parameter name="{k}" string="false">{json.dumps(v)}</｜DSML｜parameter>\n'
    return "<｜DSML｜function_calls>\n" + "".join(f'<｜DSML｜invoke name="{name}">\n' + "".join(
        param(k, v) for k, v in args.items()) + "</｜DSML｜invoke>\n" for name, args in calls) + "</｜DSML｜function_calls>"


def _kimi(rng: random.Random, calls) -> str:
    sep = rng.choice(["", "\n"])
    return "<|tool_calls_section_begin|>" + sep + sep.join(
        f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>"
        f"{json.dumps(args, indent=rng.choice([None, 2]))}<|tool_call_end|>" for i, (name, args) in enumerate(calls)
    ) + sep + "<|tool_calls_section_end|>"


FORMATS = [(Qwen3CoderToolParser, _qwen3_coder), (DeepSeekV32ToolParser, _dsml), (KimiK2ToolParser, _kimi)]
PROSE = ["", "Let me look that up.\n\n", "2 < 3 and <tool_ is not a tag; <｜DSML is not either. "]


@pytest.mark.parametrize("parser, render", FORMATS)
@pytest.mark.parametrize("seed", range(15))
def test_calls_whole_and_streamed(parser, render, seed):
    rng = random.Random(seed * 7919 + 17)
    calls = [_random_call(rng) for _ in range(rng.randint(1, 3))]
    prose = rng.choice(PROSE)
    text = prose + render(rng, calls)
    whole = parser(TOOLS).parse(text)
    assert whole.content == prose and _calls(whole) == calls, text
    for _ in range(3):
        streamed = _streamed(parser(TOOLS), text, rng)
        assert streamed.content == whole.content and _calls(streamed) == calls, text
    if parser is KimiK2ToolParser:  # the id the model wrote, which Kimi's template writes back into the history
        assert [c.id for c in whole.tool_calls] == [f"functions.{n}:{i}" for i, (n, _) in enumerate(calls)]
    else:
        assert all(c.id.startswith("call_") for c in whole.tool_calls)


@pytest.mark.parametrize("parser, render", FORMATS)
@pytest.mark.parametrize("seed", range(4))
def test_calls_to_functions_not_offered_stay_text(parser, render, seed):
    rng = random.Random(seed * 31 + 5)
    calls = [("delete_files", {"city": _text(rng)})]
    prose = rng.choice(PROSE)
    text = prose + render(rng, calls)
    for parsed in (parser(TOOLS).parse(text), _streamed(parser(TOOLS), text, rng)):
        assert not parsed.tool_calls and parsed.content.startswith(prose) and "delete_files" in parsed.content


MALFORMED = {
    Qwen3CoderToolParser: [
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</param>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>",
        "<tool_call>\n<function=get weather>\n</function>\n</tool_call>",
        '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'],  # Hermes' JSON is not this format
    DeepSeekV32ToolParser: [
        '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="days" string="false">three</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        '</｜DSML｜function_calls>',
        '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>'],
    KimiK2ToolParser: [
        '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
        '{"city": "Paris"<|tool_call_end|><|tool_calls_section_end|>',
        '<|tool_calls_section_begin|><|tool_call_begin|>get_weather<|tool_call_argument_begin|>'
        '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'],
}


@pytest.mark.parametrize("parser", list(MALFORMED))
def test_malformed_markup_stays_text(parser):
    rng = random.Random(3)
    for bad in MALFORMED[parser]:
        text = "Before. " + bad
        for parsed in (parser(TOOLS).parse(text), _streamed(parser(TOOLS), text, rng)):
            assert not parsed.tool_calls, bad
            if parser is KimiK2ToolParser:  # the section's own markers are dropped; the call stays as written
                assert parsed.content == "Before. " + bad.removeprefix("<|tool_calls_section_begin|>").removesuffix(
                    "<|tool_calls_section_end|>")
            else:
                assert parsed.content == text


def test_kimi_repeated_ids_are_made_unique():
    call = '<|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{"days": %d}<|tool_call_end|>'
    text = "<|tool_calls_section_begin|>" + call % 1 + call % 2 + "<|tool_calls_section_end|>"
    parsed = KimiK2ToolParser(TOOLS).parse(text)
    assert _calls(parsed) == [("search", {"days": 1}), ("search", {"days": 2})]
    assert parsed.tool_calls[0].id == "functions.search:0" and parsed.tool_calls[1].id.startswith("call_")


def test_cut_off_inside_a_call():
    """max_tokens cut the output inside a block: a call if what came reads as one, else text as written."""
    whole = "<tool_call>\n<function=search>\n<parameter=days>\n4\n</parameter>\n</function>\n"
    assert _calls(Qwen3CoderToolParser(TOOLS).parse(whole)) == [("search", {"days": 4})]
    cut = "<tool_call>\n<function=search>\n<parameter=days>\n4"
    assert Qwen3CoderToolParser(TOOLS).parse(cut).content == cut


def test_auto_picks_the_new_formats():
    assert detect_tool_parser("{{- '<tool_call>\\n<function=' + name + '>\\n' }}", None) == "qwen3_coder"
    assert detect_tool_parser(None, "Qwen3_5MoeForCausalLM") == "qwen3_coder"
    assert detect_tool_parser(None, "Qwen3_5MoeForConditionalGeneration") == "qwen3_coder"
    for arch in ("Qwen3NextForCausalLM", "Qwen3VLMoeForConditionalGeneration"):  # their templates write Hermes JSON
        assert detect_tool_parser(None, arch) == "hermes"
    assert detect_tool_parser(None, "DeepseekV32ForCausalLM") == "deepseek_v32"
    assert detect_tool_parser("'<｜DSML｜function_calls>'", "DeepseekV3ForCausalLM") == "deepseek_v32"
    assert detect_tool_parser(None, "GlmMoeDsaForCausalLM") == "glm45"
    assert detect_tool_parser(None, "KimiLinearForCausalLM") == "kimi_k2"
    # Kimi-K2 has DeepSeek-V3's architecture: its template decides.
    assert detect_tool_parser("{{ '<|tool_calls_section_begin|>' }}", "DeepseekV3ForCausalLM") == "kimi_k2"


# The demo's template with Qwen3.5's call format: the instructions and earlier calls written as XML.
def _qwen35_template() -> str:
    from engine.loading.demo_model import CHAT_TEMPLATE

    old_call = ("{{- '<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' }}"
                "{{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}"
                "{{- '}\\n</tool_call>' }}")
    new_call = ("{{- '<tool_call>\\n<function=' + fn.name + '>\\n' }}"
                "{%- for k, v in (fn.arguments | items if fn.arguments is mapping else []) %}"
                "{{- '<parameter=' + k + '>\\n' + (v if v is string else v | tojson) + '\\n</parameter>\\n' }}"
                "{%- endfor %}{{- '</function>\\n</tool_call>' }}")
    closed = "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"  # Qwen3.5 opens <think> unless thinking is off
    assert old_call in CHAT_TEMPLATE and closed in CHAT_TEMPLATE
    return CHAT_TEMPLATE.replace(old_call, new_call).replace(closed, closed.replace(
        "{%- endif %}", "{%- else %}{{- '<think>\\n' }}{%- endif %}")).replace(
        "return a json object with function name and arguments", "write <function=NAME> and <parameter=ARG> tags")


def test_prompts_that_open_think():
    """The Qwen3.5-style template opens <think> in its generation prompt unless enable_thinking is false; the
    demo's (Qwen3's) never does; a template that refuses the probe chat changes nothing."""
    from engine.loading.demo_model import CHAT_TEMPLATE
    from gateway.tool_parsers.think_prompt import prompt_opens_think

    assert prompt_opens_think(_qwen35_template(), {})
    assert not prompt_opens_think(_qwen35_template(), {"enable_thinking": False})
    assert not prompt_opens_think(CHAT_TEMPLATE, {}) and not prompt_opens_think(CHAT_TEMPLATE, {"enable_thinking": False})
    assert not prompt_opens_think("{{ raise_exception('no') }}<think>", {})
    # The gateway's own jinja2 sandbox renders the probe as transformers does.
    from transformers.utils.chat_template_utils import render_jinja_template

    from gateway.tool_parsers.think_prompt import _PROBE, _compiled
    tools = [{"type": "function", "function": {"name": "f", "description": "Zürich", "parameters": {"type": "object"}}}]
    for template in (CHAT_TEMPLATE, _qwen35_template()):
        for kwargs in ({}, {"enable_thinking": False}, {"tools": tools}):
            (want,), _ = render_jinja_template([_PROBE], chat_template=template, add_generation_prompt=True, **kwargs)
            assert _compiled(template).render(messages=_PROBE, add_generation_prompt=True, **kwargs) == want


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tests.gateway.in_process import in_process_server
    from tests.gateway.tenant_keys import new_tenant_key

    def qwen35_template(checkpoint: str, _db: str) -> None:
        path = f"{checkpoint}/tokenizer_config.json"
        with open(path) as f:
            config = json.load(f)
        config["chat_template"] = _qwen35_template()
        with open(path, "w") as f:
            json.dump(config, f)

    root = tmp_path_factory.mktemp("parsers_2026")
    from engine.loading.demo_model import write_demo_model
    write_demo_model(str(root / "demo"), seed=random.randrange(1000))
    with in_process_server(root, dict(dtype="float32", num_kv_blocks=128, max_num_seqs=4, max_num_batched_tokens=256,
                                      max_model_len=1024), checkpoint=str(root / "demo"),
                           before_start=qwen35_template) as srv:
        yield srv, srv.run(new_tenant_key(srv.database_url))


@pytest.mark.timeout(120)
def test_openai_client_reads_qwen35_calls(served):
    """`--tool-call-parser auto` picks qwen3_coder from the template; the model's output is forced (guided_choice)
    to Qwen3.5's reasoning (the prompt opened <think>) and a call with random values: the official client gets
    reasoning_content and the tool call, whole and streamed; with thinking off, the output is read as content."""
    srv, key = served
    rng = random.Random()
    city, days = rng.choice(["Oslo", "007", "a < b"]), rng.randint(1, 99)
    thought = rng.choice(["The user wants weather.", "Two < three; call it."])
    call = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n" + city + "\n</parameter>\n"
            f"<parameter=days>\n{days}\n</parameter>\n</function>\n</tool_call>")
    messages = [{"role": "user", "content": "Weather?"}]

    async def go(text, template_kwargs):
        client = openai.AsyncOpenAI(base_url=str(srv.server.make_url("/v1")), api_key=key, max_retries=0)
        kwargs = dict(model="demo", messages=messages, tools=TOOLS, max_tokens=200,
                      extra_body={"guided_choice": [text], "chat_template_kwargs": template_kwargs})
        try:
            whole = await client.chat.completions.create(**kwargs)
            calls, finish, content, reasoning = {}, None, "", ""
            async for chunk in await client.chat.completions.create(**kwargs, stream=True):
                choice = chunk.choices[0]
                finish = choice.finish_reason or finish
                content += choice.delta.content or ""
                reasoning += getattr(choice.delta, "reasoning_content", None) or ""
                for d in choice.delta.tool_calls or []:
                    entry = calls.setdefault(d.index, {"name": d.function.name, "arguments": ""})
                    entry["arguments"] += d.function.arguments or ""
            return whole.choices[0], calls, finish, content, reasoning
        finally:
            await client.close()

    choice, calls, finish, content, reasoning = srv.run(go(thought + "\n</think>\n\n" + call, {}))
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    assert choice.message.reasoning_content == thought + "\n" and reasoning == thought + "\n", (choice, reasoning)
    (got,) = choice.message.tool_calls
    assert got.function.name == "get_weather" and json.loads(got.function.arguments) == {"city": city, "days": days}
    assert finish == "tool_calls" and content == "" and list(calls) == [0], calls
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": city, "days": days}

    choice, calls, finish, content, reasoning = srv.run(go("Sunny. " + call, {"enable_thinking": False}))
    assert choice.message.content == "Sunny. " and not choice.message.reasoning_content and reasoning == ""
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"] and content == "Sunny. "
