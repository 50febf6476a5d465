"""GLM-4.5 / 4.6 / 4.7 format: the function name, then each argument as a key and a value, one block per call::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

Values are written as they are for strings and as JSON otherwise, so a value's type comes from the tool's
schema where the request gave one (``typed_argument``). Reasoning comes first, in ``<think>...</think>``.
"""

import json
import re

from gateway.tool_parsers.base import ToolCall, typed_argument
from gateway.tool_parsers.blocks import TextArgumentsBlockParser

_ARG = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class Glm45ToolParser(TextArgumentsBlockParser):
    name = "glm45"
    needs_special_tokens = True  # the markers are added tokens of GLM's tokenizer
    START, END = "<tool_call>", "</tool_call>"

    def calls_in(self, body: str) -> list[ToolCall] | None:
        first = body.find("<arg_key>")
        name = (body if first < 0 else body[:first]).strip()
        if not name or any(c.isspace() for c in name):
            return None
        rest, args, types = body[len(body) if first < 0 else first:], {}, self.argument_types.get(name, {})
        while rest.strip():
            match = _ARG.match(rest)
            if match is None:
                return None  # text that is not a key/value pair
            key = match.group(1).strip()
            args[key] = typed_argument(match.group(2), types.get(key))
            rest = rest[match.end():]
        return [ToolCall(name, json.dumps(args, ensure_ascii=False))]
