"""Qwen3-Coder / Qwen3.5 format: one block per call, the function and each argument as XML-like tags::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

The template writes strings as they are and objects and arrays as JSON, other values through Jinja's
``string`` filter (so booleans may read ``True``); a value's type comes from the tool's schema
(``typed_argument``). The newline the template puts around each value is not part of it.
"""

import json
import re

from gateway.tool_parsers.base import ToolCall, typed_argument
from gateway.tool_parsers.blocks import TextArgumentsBlockParser, tagged_items

_FUNCTION = re.compile(r"\s*<function=([^>\s]+)>(.*?)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _value(raw: str, schema_type: object) -> object:
    text = raw.removeprefix("\n").removesuffix("\n")
    if schema_type == "boolean" and text.strip() in ("True", "False"):  # Jinja's string of a Python bool
        return text.strip() == "True"
    return typed_argument(text, schema_type)


class Qwen3CoderToolParser(TextArgumentsBlockParser):
    name = "qwen3_coder"
    START, END = "<tool_call>", "</tool_call>"

    def calls_in(self, body: str) -> list[ToolCall] | None:
        function = _FUNCTION.fullmatch(body)
        params = tagged_items(function.group(2), _PARAMETER) if function is not None else None
        if params is None:
            return None
        name = function.group(1)
        types = self.argument_types.get(name, {})
        args = {p.group(1).strip(): _value(p.group(2), types.get(p.group(1).strip())) for p in params}
        return [ToolCall(name, json.dumps(args, ensure_ascii=False))]
