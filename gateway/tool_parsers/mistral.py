"""Mistral / Mixtral format: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (``[TOOL_CALLS]`` is a
special token, so the text must keep special tokens)."""

import json

from gateway.tool_parsers.base import ParsedDelta, ToolParser, call_from_json, held_prefix

START = "[TOOL_CALLS]"
_decoder = json.JSONDecoder()


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._pending = ""
        self._in_calls = False
        # Whether only whitespace came since the last calls: that whitespace is dropped (OpenAI sends none around
        # calls), while whitespace after other text is the text's own, kept however the text was split.
        self._after_calls = False

    def feed(self, text: str) -> ParsedDelta:
        self._pending += text
        out = ParsedDelta()
        while True:
            if self._in_calls:
                if not self._take_calls(out):
                    return out
                continue
            start = self._pending.find(START)
            if start >= 0:
                self._content(self._pending[:start], out)
                self._pending = self._pending[start + len(START):]
                self._in_calls = True
                continue
            keep = held_prefix(self._pending, START)
            if self._after_calls and not self._pending[:len(self._pending) - keep].strip():
                return out  # whitespace after calls: held until something else follows
            self._content(self._pending[:len(self._pending) - keep], out)
            self._pending = self._pending[len(self._pending) - keep:]
            return out

    def _take_calls(self, out: ParsedDelta) -> bool:
        """Parse the JSON after ``[TOOL_CALLS]`` once it is complete; False while it is not."""
        body = self._pending.lstrip()
        try:
            value, end = _decoder.raw_decode(body)
        except ValueError:
            return False  # incomplete so far (or broken: left as content at the end)
        items = value if isinstance(value, list) else [value]
        calls = [call_from_json(item) for item in items]
        self._in_calls = False
        if not items or any(c is None or not self.offers(c.name) for c in calls):
            out.content += START + body[:end]
        else:
            out.tool_calls.extend(calls)
            self._after_calls = True
        self._pending = body[end:]
        return True

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._in_calls:
            out.content += START + self._pending
        elif not (self._after_calls and not self._pending.strip()):
            out.content += self._pending
        self._pending = ""
        self._in_calls = False
        return out

    def _content(self, text: str, out: ParsedDelta) -> None:
        if not text.strip():
            if not self._after_calls:
                out.content += text
            return
        out.content += text
        self._after_calls = False
