"""Kimi-K2 / Kimi-Linear format: one section of calls, each an id (``functions.NAME:INDEX``) then the
arguments as a JSON object, between special tokens of Kimi's tokenizer::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The call keeps the id the model wrote as its ``id``: Kimi's chat template writes a call's id back into the
history, so the next turn's prompt reads as the model wrote it (an id the model repeats within one output gets
a fresh ``call_...`` id instead: a reply's ids must tell its calls apart).
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

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._ids: set[str] = set()  # the ids this output's calls were given

    def read_call(self, body: str) -> ToolCall | None:
        head, sep, args = body.partition(ARGUMENTS)
        match = _ID.fullmatch(head.strip())
        if not sep or match is None:
            return None
        try:
            call = call_from_json({"name": match.group(1), "arguments": json.loads(args)})
        except ValueError:
            return None
        if call is not None and head.strip() not in self._ids:
            call.id = head.strip()
            self._ids.add(call.id)
        return call
