"""MiniMax-M2 format: one block of one or more invocations, each argument a named parameter::

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    </minimax:tool_call>

Values are written as they are for strings and as JSON otherwise (typed from the tool's schema where the
request gave one, ``typed_argument``). Reasoning comes first, in ``<think>...</think>``.
"""

import json
import re

from gateway.tool_parsers.base import ToolCall, typed_argument
from gateway.tool_parsers.blocks import TextArgumentsBlockParser, invocations

_INVOKE = re.compile(r'\s*<invoke name="([^"]+)">(.*?)</invoke>', re.DOTALL)
_PARAMETER = re.compile(r'\s*<parameter name="([^"]+)">(.*?)</parameter>', re.DOTALL)


class MiniMaxM2ToolParser(TextArgumentsBlockParser):
    name = "minimax_m2"
    START, END = "<minimax:tool_call>", "</minimax:tool_call>"

    def calls_in(self, body: str) -> list[ToolCall] | None:
        found, calls = invocations(body, _INVOKE, _PARAMETER), []
        for name, params in found or []:
            types = self.argument_types.get(name, {})
            # The template puts each value on lines of its own: the newlines around it are not part of it.
            args = {p.group(1): typed_argument(p.group(2).strip("\n"), types.get(p.group(1))) for p in params}
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return None if found is None else calls
