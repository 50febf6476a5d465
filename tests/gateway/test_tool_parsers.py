"""Tool-call and reasoning parsers on text written as each family writes it: whole, and streamed in random
pieces (the same result however the text is split); the schemas that force calls, checked with jsonschema."""

import json
import random

import jsonschema
import pytest

from gateway.tool_parsers import (
    DeepSeekR1ReasoningParser, DeepSeekToolParser, Glm45ToolParser, HermesToolParser, KimiK2ToolParser,
    MiniMaxM2ToolParser, MistralToolParser, OpenThinkReasoningParser, ThinkReasoningParser, detect_reasoning_parser,
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


# The request's tools for the text-argument formats: "zip" is a string that looks like a number.
TYPED_TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "units": {"type": "string"}, "nested": {"type": "object"},
    "zip": {"type": "string"}}}}} for name in ("get_weather", "search")]


def _as_written(value) -> str:
    """How both templates write an argument: strings as they are, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _text_args_case(rng: random.Random, proses: list[str], render) -> tuple[str, str, list]:
    """Prose, then 1 to 3 calls with text arguments; ``render(calls)`` writes them in the format."""
    prose = rng.choice(proses)
    calls = [(rng.choice(["get_weather", "search"]), {**_random_args(rng), "zip": rng.choice(["75001", "8001", "null"])})
             for _ in range(rng.randint(1, 3))]
    return prose + render(calls), prose, calls


def _glm45_case(rng: random.Random) -> tuple[str, str, list]:
    """GLM-4.5 text as its chat template writes calls: <tool_call> blocks of key/value pairs."""
    def render(calls):
        return "\n".join(f"<tool_call>{name}\n" + "".join(
            f"<arg_key>{k}</arg_key>\n<arg_value>{_as_written(v)}</arg_value>\n" for k, v in args.items())
            + "</tool_call>" for name, args in calls)
    return _text_args_case(rng, ["", "Let me look that up.\n", "2 < 3 and <tool_ is not a tag. "], render)


def _minimax_case(rng: random.Random) -> tuple[str, str, list]:
    """MiniMax-M2 text: one <minimax:tool_call> block of one or more <invoke>s."""
    def render(calls):
        return "<minimax:tool_call>\n" + "".join(f'<invoke name="{name}">\n' + "".join(
            f'<parameter name="{k}">{_as_written(v)}</parameter>\n' for k, v in args.items()) + "</invoke>\n"
            for name, args in calls) + "</minimax:tool_call>"
    return _text_args_case(rng, ["", "Let me check.\n\n", 'x <invoke name="f"> is text here. '], render)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("parser,case", [(Glm45ToolParser, _glm45_case), (MiniMaxM2ToolParser, _minimax_case)])
def test_text_argument_calls_whole_and_streamed(parser, case, seed):
    rng = random.Random(seed * 104729 + 3)
    text, prose, calls = case(rng)
    for parsed in (parser(TYPED_TOOLS).parse(text), _streamed(parser(TYPED_TOOLS), text, rng)):
        assert parsed.content == prose and _calls(parsed) == calls, text
    # Without the schemas, a value that reads as JSON is taken as JSON: the number-like zip string is not kept.
    untyped = _calls(parser().parse(text))
    assert [name for name, _ in untyped] == [name for name, _ in calls]
    assert all(args["city"] == want["city"] and args["days"] == want["days"] for (_, args), (_, want) in zip(untyped, calls))


def test_text_argument_blocks_that_do_not_read_stay_content():
    rng = random.Random(11)
    glm_bad = "<tool_call>get weather\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>"  # space in the name
    glm_ok = "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>[1, 2]</arg_value>\n</tool_call>"
    text = "Before. " + glm_bad + " After " + glm_ok
    for parsed in (Glm45ToolParser().parse(text), _streamed(Glm45ToolParser(), text, rng)):
        assert parsed.content == "Before. " + glm_bad + " After "
        assert _calls(parsed) == [("f", {"a": [1, 2]})]
    mm_bad = '<minimax:tool_call>\n<invoke name="f">\n<parameter name="a">1</param>\n</invoke>\n</minimax:tool_call>'
    for parsed in (MiniMaxM2ToolParser().parse(mm_bad), _streamed(MiniMaxM2ToolParser(), mm_bad, rng)):
        assert parsed.content == mm_bad and not parsed.tool_calls
    # Cut off inside a block (max_tokens): a block that reads is still a call, one that does not is text.
    cut = '<minimax:tool_call>\n<invoke name="f">\n<parameter name="a">x</parameter>\n</invoke>\n'
    assert _calls(MiniMaxM2ToolParser().parse(cut)) == [("f", {"a": "x"})]
    assert Glm45ToolParser().parse("<tool_call>f\n<arg_key>a</arg").content == "<tool_call>f\n<arg_key>a</arg"


@pytest.mark.parametrize("seed", range(8))
def test_reasoning_opened_by_the_prompt_whole_and_streamed(seed):
    rng = random.Random(seed)
    thought = rng.choice(["", "Step 1: 2 < 3.\n", "Is </thin k> a tag?\n"])
    answer = rng.choice(["Paris.", "", "Line one.\nLine two."])
    closed = rng.random() < 0.7
    text, want = (thought + "</think>\n\n" + answer, (thought, answer)) if closed else (thought, (thought, ""))
    for parsed in (OpenThinkReasoningParser().parse(text),
                   _streamed(OpenThinkReasoningParser(), text, rng) if len(text) > 1 else OpenThinkReasoningParser().parse(text)):
        assert (parsed.reasoning, parsed.content) == want


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


def _kimi_case(rng: random.Random) -> tuple[str, str, list]:
    """Kimi-K2's section of calls (``functions.NAME:i`` ids, JSON arguments) after optional prose."""
    prose = rng.choice(["", "Let me check.\n\n"])
    calls = [(rng.choice(["get_weather", "search"]), _random_args(rng)) for _ in range(rng.randint(1, 3))]
    return prose + "<|tool_calls_section_begin|>" + "".join(
        f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{json.dumps(args)}<|tool_call_end|>"
        for i, (name, args) in enumerate(calls)) + "<|tool_calls_section_end|>", prose, calls


def _words(rng: random.Random) -> str:
    """Prose with spaces at many places (where a tokenizer's pieces begin: " the", " answer")."""
    return " ".join(rng.choice(["Then", "I", "will", "answer:", "2", "<", "3", "São", "Paulo."])
                    for _ in range(rng.randint(2, 8)))


@pytest.mark.parametrize("parser, case", [(DeepSeekToolParser, _deepseek_case), (KimiK2ToolParser, _kimi_case),
                                          (MistralToolParser, _mistral_case)])
@pytest.mark.parametrize("seed", range(6))
def test_text_after_the_calls_keeps_its_spaces_however_it_is_split(parser, case, seed):
    """Text after the calls (a model that goes on writing), and stray text inside a section of calls (a model that
    breaks its format), is content with its inner spaces, streamed as whole: cut at every place, and at random
    places. The reference: what follows a section is content without its leading whitespace, what follows
    Mistral's calls is content as written, and stray text in a section is content from its first non-space."""
    rng = random.Random(seed * 613 + 1)
    text, prose, calls = case(rng)
    tail = rng.choice(["", " ", "\n"]) + _words(rng) + rng.choice(["", " ", "\n"])
    cases = [(text + tail, prose + (tail if parser is MistralToolParser else tail.lstrip()), calls)]
    if parser is not MistralToolParser:
        begin = parser.SECTION_BEGIN
        cases.append((prose + begin + tail, prose + tail.lstrip(), []))
    for text, want, want_calls in cases:
        whole = parser(TYPED_TOOLS).parse(text)
        assert (whole.content, _calls(whole)) == (want, want_calls), text
        pieces = [[i] for i in range(1, len(text))] + [sorted(rng.sample(range(1, len(text)), k=rng.randint(
            1, len(text) // 2))) for _ in range(5)]
        for cuts in pieces:
            streamed, p = None, parser(TYPED_TOOLS)
            for a, b in zip([0, *cuts], [*cuts, len(text)]):
                piece = p.feed(text[a:b])
                streamed = piece if streamed is None else streamed.__iadd__(piece)
            streamed += p.finish()
            assert (streamed.content, _calls(streamed)) == (want, want_calls), (text, cuts)


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
    assert detect_tool_parser("... <tool_call>{{ name }}<arg_key>{{ k }}</arg_key> ...", None) == "glm45"
    assert detect_tool_parser("<minimax:tool_call>", None) == "minimax_m2"
    assert detect_tool_parser(None, "Glm4MoeForCausalLM") == "glm45"
    assert detect_tool_parser(None, "MiniMaxM2ForCausalLM") == "minimax_m2"
    assert detect_reasoning_parser("]~b]ai\n<think>\n") == "minimax_m2"
    assert detect_reasoning_parser("<|assistant|><think></think>") == "qwen3"
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


def test_harmony_detection():
    """gpt-oss's output is read by openai-harmony from token ids (tests/gateway/test_harmony.py); picked here by the
    template's channels or the architecture."""
    template = "{{- '<|start|>assistant<|channel|>final<|message|>' }}"
    assert detect_tool_parser(template, None) == detect_reasoning_parser(template) == "harmony"
    assert detect_tool_parser(None, "GptOssForCausalLM") == detect_reasoning_parser(None, "GptOssForCausalLM") == "harmony"
    assert detect_reasoning_parser(None, "Qwen3MoeForCausalLM") is None


@pytest.mark.parametrize("parser, case", [
    (HermesToolParser, _hermes_case), (MistralToolParser, _mistral_case), (Glm45ToolParser, _glm45_case),
    (MiniMaxM2ToolParser, _minimax_case), (DeepSeekToolParser, _deepseek_case)])
@pytest.mark.parametrize("seed", range(6))
def test_calls_to_functions_not_offered_stay_text(parser, case, seed):
    """A call naming a function the request's tools do not list is not a tool call: it stays in the content as
    the model wrote it (its name is there), whole and streamed; offered names are calls as before."""
    rng = random.Random(seed * 31 + 7)
    text, prose, calls = case(rng)
    offered = [t for t in TYPED_TOOLS if t["function"]["name"] in {n for n, _ in calls}]
    for parsed in (parser(offered).parse(text), _streamed(parser(offered), text, rng)):
        assert parsed.content == prose and [n for n, _ in _calls(parsed)] == [n for n, _ in calls], text
    other = [{"type": "function", "function": {"name": "unrelated", "parameters": {"type": "object"}}}]
    for parsed in (parser(other).parse(text), _streamed(parser(other), text, rng)):
        assert not parsed.tool_calls, text
        assert parsed.content.startswith(prose) and all(name in parsed.content for name, _ in calls), parsed.content
