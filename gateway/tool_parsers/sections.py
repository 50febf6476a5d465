"""Formats that write all calls in one section, each call between its own markers (special tokens of the
family's tokenizer): the streaming shared by DeepSeek-V3 / V3.1 and Kimi-K2 / Kimi-Linear; each format says
how to read one call's body.

Text before the section is content; whitespace between the markers is dropped; a call that does not read, or
names a function the request did not offer, stays in the content as written (with its markers).
"""

import abc

from gateway.tool_parsers.base import ParsedDelta, ToolCall, ToolParser, held_prefix


class SectionToolParser(ToolParser):
    SECTION_BEGIN = SECTION_END = CALL_BEGIN = CALL_END = ""
    needs_special_tokens = True

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._pending = ""
        # content -> section (between calls) -> call -> section ... -> after (leading whitespace dropped) -> text
        self._state = "content"

    @abc.abstractmethod
    def read_call(self, body: str) -> ToolCall | None:
        """One call's text between its markers -> a call, or None if it does not read as one."""

    def feed(self, text: str) -> ParsedDelta:
        self._pending += text
        out = ParsedDelta()
        while True:
            if self._state == "content":
                start = self._pending.find(self.SECTION_BEGIN)
                if start < 0:
                    keep = held_prefix(self._pending, self.SECTION_BEGIN)
                    out.content += self._pending[:len(self._pending) - keep]
                    self._pending = self._pending[len(self._pending) - keep:]
                    return out
                out.content += self._pending[:start]
                self._pending, self._state = self._pending[start + len(self.SECTION_BEGIN):], "section"
            elif self._state == "section":
                self._pending = self._pending.lstrip()
                if self._pending.startswith(self.CALL_BEGIN):
                    self._pending, self._state = self._pending[len(self.CALL_BEGIN):], "call"
                elif self._pending.startswith(self.SECTION_END):
                    self._pending, self._state = self._pending[len(self.SECTION_END):], "after"
                elif self.CALL_BEGIN.startswith(self._pending) or self.SECTION_END.startswith(self._pending):
                    return out  # a marker still arriving (or nothing yet)
                else:  # stray text inside the section: content, as written (and all that follows it)
                    out.content += self._pending
                    self._pending, self._state = "", "text"
            elif self._state == "call":
                end = self._pending.find(self.CALL_END)
                if end < 0:
                    return out
                body, self._pending = self._pending[:end], self._pending[end + len(self.CALL_END):]
                self._emit(body, out, self.CALL_END)
                self._state = "section"
            elif self._state == "after":  # what follows the section (normally nothing) is content, without the
                self._pending = self._pending.lstrip()  # whitespace that leads it: not a piece's own leading space
                if self._pending:
                    self._state = "text"
                    continue
                return out
            else:  # text after the section: content as written
                out.content += self._pending
                self._pending = ""
                return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._state == "call":  # cut off inside a call: a call if it reads
            self._emit(self._pending, out, "")
        elif self._state in ("content", "after", "text"):
            out.content += self._pending
        self._pending, self._state = "", "content"
        return out

    def _emit(self, body: str, out: ParsedDelta, end: str) -> None:
        call = self.read_call(body)
        if call is None or not self.offers(call.name):
            out.content += self.CALL_BEGIN + body + end
        else:
            out.tool_calls.append(call)
