"""Tool-call and reasoning parsers on text written as each family writes it: whole, and streamed in random
pieces (the same result however the text is split); the schemas that force calls, checked with jsonschema."""

import json
import random

import jsonschema
import pytest

from gateway.tool_parsers import (
    DeepSeekR1ReasoningParser, DeepSeekToolParser, HermesToolParser, MistralToolParser, ThinkReasoningParser,
    detect_tool_parser,
)
from gateway.tool_parsers import forced


def _random_args(rng: random.Random) -> dict:
    return {"city": rng.choice(["Paris", "Zürich", "São Paulo", 'a "quoted" name']), "days": rng.randint(1, 9),
            "units": rng.choice(["c", "f"]), "nested": {"list": [rng.random() for _ in range(rng.randint(0, 3))]}}


def _streamed(parser, text: str, rng: random.Random):
    """``text`` fed in random pieces (1 to 12 characters); the pieces joined."""
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, max(1, len(text) // 3)))))
    out = None
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        piece = parser.feed(text[a:b])
        out = piece if out is None else (out.__iadd__(piece))
    out += parser.finish()
    return out


def _calls(parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def _hermes_case(rng: random.Random) -> tuple[str, str, list]:
    """Qwen-style text: optional prose, then one or more <tool_call> blocks (pretty or compact JSON)."""
    prose = rng.choice(["", "Let me look that up.\n\n", "I'll check < and > signs first. "])
    calls = [(rng.choice(["get_weather", "search"]), _random_args(rng)) for _ in range(rng.randint(1, 3))]
    blocks = []
    for name, args in calls:
        obj = {"name": name, "arguments": args}
        blocks.append("<tool_call>\n" + json.dumps(obj, ensure_ascii=rng.random() < 0.5) + "\n</tool_call>")
    return prose + "\n".join(blocks), prose, calls


@pytest.mark.parametrize("seed", range(20))
def test_hermes_calls_whole_and_streamed(seed):
    rng = random.Random(seed * 7919 + 1)
    text, prose, calls = _hermes_case(rng)
    whole = HermesToolParser().parse(text)
    assert whole.content == prose and _calls(whole) == calls
    assert all(c.id.startswith("call_") for c in whole.tool_calls)
    streamed = _streamed(HermesToolParser(), text, rng)
    assert streamed.content == whole.content and _calls(streamed) == calls


def test_hermes_broken_json_stays_content_and_text_between():
    rng = random.Random(5)
    broken = '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>'  # one brace short
    text = "Before. " + broken + ' After <tool_call>{"name": "g", "arguments": {"b": [1, 2]}}</tool_call>'
    for parsed in (HermesToolParser().parse(text), _streamed(HermesToolParser(), text, rng)):
        assert parsed.content == "Before. " + broken + " After "
        assert _calls(parsed) == [("g", {"b": [1, 2]})]
    # No call at all: the text is the content, a lone "<" included.
    plain = "x < y and <tool that is not a call"
    assert HermesToolParser().parse(plain).content == plain
    assert _streamed(HermesToolParser(), plain, rng).content == plain
    # Cut off inside a call (max_tokens): content as written; a closed JSON without </tool_call> is a call.
    assert HermesToolParser().parse('<tool_call>{"name": "f", "argu').content == '<tool_call>{"name": "f", "argu'
    assert _calls(HermesToolParser().parse('<tool_call>{"name": "f", "arguments": {}}')) == [("f", {})]


def _mistral_case(rng: random.Random) -> tuple[str, str, list]:
    prose = rng.choice(["", "Sure. "])
    calls = [(rng.choice(["get_weather", "search"]), _random_args(rng)) for _ in range(rng.randint(1, 3))]
    items = [{"name": n, "arguments": a} | ({"id": "abcDEF123"} if rng.random() < 0.5 else {}) for n, a in calls]
    return prose + "[TOOL_CALLS]" + rng.choice(["", " "]) + json.dumps(items), prose, calls


@pytest.mark.parametrize("seed", range(20))
def test_mistral_calls_whole_and_streamed(seed):
    rng = random.Random(seed * 104729 + 3)
    text, prose, calls = _mistral_case(rng)
    whole = MistralToolParser().parse(text)
    assert whole.content == prose and _calls(whole) == calls
    streamed = _streamed(MistralToolParser(), text, rng)
    assert streamed.content == prose and _calls(streamed) == calls


def test_mistral_broken_json_stays_content():
    rng = random.Random(11)
    for text in ['[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}', '[TOOL_CALLS][{"arguments": {}}]',
                 "no calls here [TOOL_CALL"]:
        assert MistralToolParser().parse(text).content == text
        assert _streamed(MistralToolParser(), text, rng).content == text
        assert not MistralToolParser().parse(text).tool_calls


@pytest.mark.parametrize("seed", range(20))
def test_reasoning_whole_and_streamed(seed):
    rng = random.Random(seed)
    thought = rng.choice(["", "\nThe user wants <b>bold</b> text; 2 < 3.\n", "Think </thin k> twice.\n"])
    answer = rng.choice(["Paris.", "", "<think> is only text here", "Line one.\nLine two."])
    kind = rng.choice(["closed", "open", "none"])
    if kind == "closed":
        text, want = "<think>" + thought + "</think>\n\n" + answer, (thought, answer)
    elif kind == "open":  # cut off while thinking
        text, want = "<think>" + thought, (thought, "")
    else:  # thinking off: the answer is all content (an answer that opened with <think> would be reasoning)
        answer = answer.replace("<think>", "think") or "x"
        text, want = answer, ("", answer)
    whole = ThinkReasoningParser().parse(text)
    assert (whole.reasoning, whole.content) == want
    streamed = _streamed(ThinkReasoningParser(), text, rng) if len(text) > 1 else ThinkReasoningParser().parse(text)
    assert (streamed.reasoning, streamed.content) == want


def _deepseek_case(rng: random.Random) -> tuple[str, str, list]:
    """DeepSeek-V3's section of calls (type, name, fenced JSON) or V3.1's (name, bare JSON), after optional prose."""
    prose = rng.choice(["", "Let me check.\n\n", "Comparing 2 < 3 first. "])
    calls = [(rng.choice(["get_weather", "search"]), _random_args(rng)) for _ in range(rng.randint(1, 3))]
    v31 = rng.random() < 0.5
    blocks = []
    for name, args in calls:
        js = json.dumps(args, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 2]))
        body = f"{name}<｜tool▁sep｜>{js}" if v31 else f"function<｜tool▁sep｜>{name}\n```json\n{js}\n```"
        blocks.append(f"<｜tool▁call▁begin｜>{body}<｜tool▁call▁end｜>")
    sep = rng.choice(["", "\n"])
    return prose + "<｜tool▁calls▁begin｜>" + sep.join(blocks) + "<｜tool▁calls▁end｜>", prose, calls


@pytest.mark.parametrize("seed", range(20))
def test_deepseek_calls_whole_and_streamed(seed):
    rng = random.Random(seed * 7927 + 5)
    text, prose, calls = _deepseek_case(rng)
    for parsed in (DeepSeekToolParser().parse(text), _streamed(DeepSeekToolParser(), text, rng)):
        assert parsed.content == prose and _calls(parsed) == calls, text


def test_deepseek_broken_call_stays_content():
    body = "function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \n```"
    text = f"Hi <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{body}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    parsed = DeepSeekToolParser().parse(text)
    assert not parsed.tool_calls and parsed.content == f"Hi <｜tool▁call▁begin｜>{body}<｜tool▁call▁end｜>"


@pytest.mark.parametrize("seed", range(10))
def test_deepseek_r1_reasoning_whole_and_streamed(seed):
    """R1 starts inside its reasoning (the prompt opened <think>); an explicit opening tag is accepted too."""
    rng = random.Random(seed)
    thought = rng.choice(["The user wants <b>bold</b>; 2 < 3.\n", "Think </thin k> twice.\n"])
    answer = rng.choice(["Paris.", "Line one.\nLine two."])
    opening = rng.choice(["", "<think>\n", "<think>"])
    said = opening.removeprefix("<think>") + thought  # what follows an explicit tag is kept, as with Qwen3's
    cases = [(opening + thought + "</think>\n\n" + answer, (said, answer)), (opening + thought, (said, ""))]
    for text, want in cases:
        for parsed in (DeepSeekR1ReasoningParser().parse(text), _streamed(DeepSeekR1ReasoningParser(), text, rng)):
            assert (parsed.reasoning, parsed.content) == want, text


def test_parser_detection():
    assert detect_tool_parser("... <tool_call> ...", None) == "hermes"
    assert detect_tool_parser("{% if x %}[TOOL_CALLS]{% endif %}", None) == "mistral"
    assert detect_tool_parser(None, "MixtralForCausalLM") == "mistral"
    assert detect_tool_parser("", "OlmoeForCausalLM") is None
    assert detect_tool_parser("{{'<｜tool▁calls▁begin｜>'}}", None) == "deepseek_v3"
    assert detect_tool_parser(None, "DeepseekV3ForCausalLM") == "deepseek_v3"


def test_forcing_schemas_accept_calls_and_refuse_others():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
                 "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
             {"type": "function", "function": {"name": "now"}}]
    required = json.loads(forced.required_schema(tools, parallel=True))
    good = [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "now", "parameters": {}}]
    jsonschema.validate(good, required)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    with pytest.raises(jsonschema.ValidationError):  # one call only without parallel calls
        jsonschema.validate(good, json.loads(forced.required_schema(tools, parallel=False)))
    calls = forced.calls_from_output(json.dumps(good), None)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}), ("now", {})]
    named = forced.calls_from_output('{"city": "Oslo"}', "get_weather")
    assert [(c.name, json.loads(c.arguments)) for c in named] == [("get_weather", {"city": "Oslo"})]
    assert forced.calls_from_output('{"city": "Os', "get_weather") is None
    assert json.loads(forced.named_schema(tools[1])) == forced.EMPTY_PARAMETERS


def test_partial_calls_of_a_cut_output():
    """A required-call array cut anywhere: the complete calls, then the begun one (once its name is whole)
    with its arguments as far as they got; a named call's arguments are the text itself."""
    import random

    items = [{"name": random.choice(["get_weather", "take_note"]),
              "parameters": {"city": random.choice(["Oslo", "Lima"]), "days": random.randint(1, 7)}}
             for _ in range(random.randint(1, 3))]
    text = json.dumps(items, separators=(",", ":"))  # compact, as the grammar writes it
    starts, pos = [], 1
    for item in items:
        starts.append(pos)
        pos += len(json.dumps(item, separators=(",", ":"))) + 1
    for cut in range(len(text) + 1):
        calls = forced.partial_calls(text[:cut], None)
        for i, call in enumerate(calls):
            assert call.name == items[i]["name"]
            if cut >= starts[i] + len(json.dumps(items[i], separators=(",", ":"))):  # this item is whole
                assert json.loads(call.arguments) == items[i]["parameters"]
            else:
                assert json.dumps(items[i]["parameters"], separators=(",", ":")).startswith(call.arguments)
        whole_names = sum(cut >= s + len('{"name":"') + len(it["name"]) + 1 for s, it in zip(starts, items))
        assert len(calls) == whole_names, (cut, text[:cut], calls)
    assert forced.partial_calls('{"city":"Os', "get_weather")[0].arguments == '{"city":"Os'
