"""Qwen / Hermes format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call."""

import json

from gateway.tool_parsers.base import ToolCall, call_from_json
from gateway.tool_parsers.blocks import BlockToolParser


class HermesToolParser(BlockToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def calls_in(self, body: str) -> list[ToolCall] | None:
        try:
            call = call_from_json(json.loads(body))
        except ValueError:
            return None
        return [call] if call is not None else None
