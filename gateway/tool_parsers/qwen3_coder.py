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
from gateway.tool_parsers.blocks import TextArgumentsBlockParser

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
        if function is None:
            return None
        name, params, args = function.group(1), function.group(2), {}
        types = self.argument_types.get(name, {})
        while params.strip():
            param = _PARAMETER.match(params)
            if param is None:
                return None  # text that is not a parameter
            key = param.group(1).strip()
            args[key] = _value(param.group(2), types.get(key))
            params = params[param.end():]
        return [ToolCall(name, json.dumps(args, ensure_ascii=False))]
