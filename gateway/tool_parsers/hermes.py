"""Qwen / Hermes format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call."""

import json

from gateway.tool_parsers.base import ParsedDelta, ToolParser, call_from_json, held_prefix

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def __init__(self) -> None:
        self._pending = ""
        self._in_call = False
        self._calls = 0  # complete calls so far (whitespace after one is not content)

    def feed(self, text: str) -> ParsedDelta:
        self._pending += text
        out = ParsedDelta()
        while True:
            if self._in_call:
                end = self._pending.find(END)
                if end < 0:
                    return out
                body, self._pending = self._pending[:end], self._pending[end + len(END):]
                self._in_call = False
                self._close(body, out, closed=True)
                continue
            start = self._pending.find(START)
            if start >= 0:
                self._content(self._pending[:start], out, final=True)
                self._pending = self._pending[start + len(START):]
                self._in_call = True
                continue
            keep = held_prefix(self._pending, START)
            text_part = self._pending[:len(self._pending) - keep]
            emitted = self._content(text_part, out, final=False)
            self._pending = self._pending[emitted:]
            return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._in_call:  # cut off before </tool_call> (or the model ended without it): a call if it parses
            self._close(self._pending, out, closed=False)
        else:
            self._content(self._pending, out, final=True, at_end=True)
        self._pending = ""
        self._in_call = False
        return out

    def _content(self, text: str, out: ParsedDelta, final: bool, at_end: bool = False) -> int:
        """Emit ``text`` as content; returns how many characters were used. After a call, whitespace is
        held until something else follows (dropped if a call or the end does)."""
        if self._calls and not text.strip():
            if final:
                return len(text)  # whitespace between calls, or after the last one
            return 0
        out.content += text
        return len(text)

    def _close(self, body: str, out: ParsedDelta, closed: bool) -> None:
        try:
            call = call_from_json(json.loads(body))
        except ValueError:
            call = None
        if call is None:  # not a call: the text stays, as the model wrote it
            out.content += START + body + (END if closed else "")
            return
        self._calls += 1
        out.tool_calls.append(call)
