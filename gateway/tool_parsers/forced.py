"""``tool_choice`` ``required`` and named, enforced by grammar-constrained decoding.

The output is held to a JSON schema (``SamplingParams.structured_output``) and then read back as calls:
named -> the function's ``parameters`` schema, the output is that call's arguments; required -> an array of
``{"name": <one of the tools>, "parameters": <its schema>}`` (at least one; exactly one without parallel
tool calls).
"""

import json
import re

from gateway.tool_parsers.base import ToolCall

EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # no arguments: {} only


def parameters_of(tool: dict) -> dict:
    return tool["function"].get("parameters") or EMPTY_PARAMETERS


def named_schema(tool: dict) -> str:
    return json.dumps(parameters_of(tool))


def required_schema(tools: list[dict], parallel: bool) -> str:
    alternatives = [{"type": "object",
                     "properties": {"name": {"const": t["function"]["name"]}, "parameters": parameters_of(t)},
                     "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}}
    if not parallel:
        schema["maxItems"] = 1
    return json.dumps(schema)


def calls_from_output(text: str, named: str | None) -> list[ToolCall] | None:
    """The calls a forced output holds (``named``: the named function's, else ``required``'s array);
    None if the text is not that JSON (an output cut off by max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if named is not None:
        return [ToolCall(named, json.dumps(value, ensure_ascii=False))] if isinstance(value, dict) else None
    if not isinstance(value, list) or not value:
        return None
    calls = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not isinstance(item.get("parameters"), dict):
            return None
        calls.append(ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)))
    return calls


_decoder = json.JSONDecoder()
# The start of one item of ``required``'s array, as the grammar writes it (compact, keys in schema order).
_ITEM_HEAD = re.compile(r'\{"name":("(?:[^"\\]|\\.)*")')
_PARAMETERS = ',"parameters":'


def partial_calls(text: str, named: str | None) -> list[ToolCall]:
    """The calls an output cut off by max_tokens had begun: every complete one, and the last with its
    arguments as far as they got (JSON text that does not parse), as vLLM returns them; a call whose name
    was not complete yet is dropped. ``named``: the whole text is that function's arguments."""
    if named is not None:
        return [ToolCall(named, text)]
    calls = []
    pos = 1 if text.startswith("[") else len(text)
    while pos < len(text):
        try:
            item, end = _decoder.raw_decode(text, pos)
        except ValueError:
            head = _ITEM_HEAD.match(text, pos)
            if head is not None:  # arguments begin after "parameters": (none yet while that key is cut)
                rest = text[head.end():]
                arguments = rest[len(_PARAMETERS):] if rest.startswith(_PARAMETERS) else ""
                calls.append(ToolCall(json.loads(head.group(1)), arguments))
            break
        if isinstance(item, dict) and isinstance(item.get("name"), str):
            calls.append(ToolCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False)))
        pos = end + 1 if text.startswith(",", end) else len(text)
    return calls
