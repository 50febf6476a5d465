"""Kimi-K2 / Kimi-Linear format: one section of calls, each an id (``functions.NAME:INDEX``) then the
arguments as a JSON object, between special tokens of Kimi's tokenizer::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The call keeps the id the model wrote as its ``id``: Kimi's chat template writes a call's id back into the
history, so the next turn's prompt reads as the model wrote it.
"""

import json
import re

from gateway.tool_parsers.base import ToolCall, call_from_json
from gateway.tool_parsers.sections import SectionToolParser

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, CALL_END, ARGUMENTS = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
_ID = re.compile(r"(?:functions\.)?([^\s:]+):\d+")


class KimiK2ToolParser(SectionToolParser):
    name = "kimi_k2"
    SECTION_BEGIN, SECTION_END, CALL_BEGIN, CALL_END = SECTION_BEGIN, SECTION_END, CALL_BEGIN, CALL_END

    def read_call(self, body: str) -> ToolCall | None:
        head, sep, args = body.partition(ARGUMENTS)
        match = _ID.fullmatch(head.strip())
        if not sep or match is None:
            return None
        try:
            call = call_from_json({"name": match.group(1), "arguments": json.loads(args)})
        except ValueError:
            return None
        if call is not None:
            call.id = head.strip()
        return call
