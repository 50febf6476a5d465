"""Formats that write each call (or group of calls) between a start and an end marker, with text around them:
the streaming shared by Hermes, GLM-4.5 and MiniMax-M2; each format says how to read one block's body."""

import abc
import re

from gateway.tool_parsers.base import ParsedDelta, ToolCall, ToolParser, argument_types, held_prefix


class BlockToolParser(ToolParser):
    """Text outside ``START ... END`` blocks is content; a block whose body does not read as calls is left in
    the content as written. Text that may still begin ``START`` is held back while streaming."""

    START = ""
    END = ""

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._pending = ""
        self._in_call = False
        self._calls = 0  # complete calls so far (whitespace after one is not content)

    @abc.abstractmethod
    def calls_in(self, body: str) -> list[ToolCall] | None:
        """The calls one block's body holds, or None if it is not a well-formed block."""

    def feed(self, text: str) -> ParsedDelta:
        self._pending += text
        out = ParsedDelta()
        while True:
            if self._in_call:
                end = self._pending.find(self.END)
                if end < 0:
                    return out
                body, self._pending = self._pending[:end], self._pending[end + len(self.END):]
                self._in_call = False
                self._close(body, out, closed=True)
                continue
            start = self._pending.find(self.START)
            if start >= 0:
                self._content(self._pending[:start], out, final=True)
                self._pending = self._pending[start + len(self.START):]
                self._in_call = True
                continue
            keep = held_prefix(self._pending, self.START)
            text_part = self._pending[:len(self._pending) - keep]
            emitted = self._content(text_part, out, final=False)
            self._pending = self._pending[emitted:]
            return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._in_call:  # cut off before the end marker (or the model ended without it): calls if it reads
            self._close(self._pending, out, closed=False)
        else:
            self._content(self._pending, out, final=True)
        self._pending = ""
        self._in_call = False
        return out

    def _content(self, text: str, out: ParsedDelta, final: bool) -> int:
        """Emit ``text`` as content; returns how many characters were used. After a call, whitespace is
        held until something else follows (dropped if a call or the end does)."""
        if self._calls and not text.strip():
            if final:
                return len(text)  # whitespace between calls, or after the last one
            return 0
        out.content += text
        return len(text)

    def _close(self, body: str, out: ParsedDelta, closed: bool) -> None:
        calls = self.calls_in(body)
        if not calls or not all(self.offers(c.name) for c in calls):  # not a call we offered: the text stays
            out.content += self.START + body + (self.END if closed else "")
            return
        self._calls += len(calls)
        out.tool_calls.extend(calls)


class TextArgumentsBlockParser(BlockToolParser):
    """A block format that writes each argument as text (strings as they are, other values as JSON): the
    request's tools give each argument's type (``base.typed_argument``)."""

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self.argument_types = argument_types(tools)  # {function: {argument: JSON Schema type}}


def tagged_items(text: str, pattern: re.Pattern) -> list[re.Match] | None:
    """``text`` read as a run of ``pattern``'s matches (the pattern takes the whitespace before each), or None
    where anything else stands in it."""
    found = []
    while text.strip():
        match = pattern.match(text)
        if match is None:
            return None
        found.append(match)
        text = text[match.end():]
    return found


def invocations(body: str, invoke: re.Pattern, parameter: re.Pattern) -> list[tuple[str, list[re.Match]]] | None:
    """A block's body read as invocations (``invoke``'s groups: the name, then the parameters' text) ->
    [(name, ``parameter``'s matches)], or None where it does not read so (MiniMax-M2, DeepSeek-V3.2)."""
    found = []
    for call in tagged_items(body, invoke) or [None]:
        params = tagged_items(call.group(2), parameter) if call is not None else None
        if params is None:
            return None
        found.append((call.group(1).strip(), params))
    return found
