"""DeepSeek-V3 / R1 / V3.1 tool calls, and R1's reasoning.

Calls come in one section, each call in its own markers (special tokens of DeepSeek's tokenizer)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

V3.1 writes ``NAME<｜tool▁sep｜>{...}`` inside the call markers instead (no type, no fence); both are read.
Text before the section is content; a call that does not parse stays in the content as written.
"""

import json

from gateway.tool_parsers.base import ParsedDelta, ToolParser, call_from_json, held_prefix
from gateway.tool_parsers.reasoning import START as THINK_START, ThinkReasoningParser

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def _call(body: str):
    """One call's text between its markers -> a ToolCall, or None."""
    head, sep, tail = body.partition(SEP)
    if not sep:
        return None
    name, args = head.strip(), tail.strip()
    if head.strip() in ("function", "") and "```" in tail:  # V3: type, then NAME and a fenced JSON block
        name, _, fenced = tail.partition("\n")
        args = fenced.strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
        name = name.strip()
    try:
        return call_from_json({"name": name, "arguments": json.loads(args)})
    except ValueError:
        return None


class DeepSeekToolParser(ToolParser):
    name = "deepseek_v3"
    needs_special_tokens = True

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._pending = ""
        self._state = "content"  # content -> section (between calls) -> call -> section ... -> after

    def feed(self, text: str) -> ParsedDelta:
        self._pending += text
        out = ParsedDelta()
        while True:
            if self._state == "content":
                start = self._pending.find(CALLS_BEGIN)
                if start < 0:
                    keep = held_prefix(self._pending, CALLS_BEGIN)
                    out.content += self._pending[:len(self._pending) - keep]
                    self._pending = self._pending[len(self._pending) - keep:]
                    return out
                out.content += self._pending[:start]
                self._pending, self._state = self._pending[start + len(CALLS_BEGIN):], "section"
            elif self._state == "section":
                self._pending = self._pending.lstrip()
                if self._pending.startswith(CALL_BEGIN):
                    self._pending, self._state = self._pending[len(CALL_BEGIN):], "call"
                elif self._pending.startswith(CALLS_END):
                    self._pending, self._state = self._pending[len(CALLS_END):], "after"
                elif CALL_BEGIN.startswith(self._pending) or CALLS_END.startswith(self._pending):
                    return out  # a marker still arriving (or nothing yet)
                else:  # stray text inside the section: content, as written
                    out.content += self._pending
                    self._pending, self._state = "", "after"
            elif self._state == "call":
                end = self._pending.find(CALL_END)
                if end < 0:
                    return out
                body, self._pending = self._pending[:end], self._pending[end + len(CALL_END):]
                call = _call(body)
                if call is None or not self.offers(call.name):
                    out.content += CALL_BEGIN + body + CALL_END
                else:
                    out.tool_calls.append(call)
                self._state = "section"
            else:  # after the section: what follows (normally nothing) is content, without leading whitespace
                self._pending = self._pending.lstrip()
                out.content += self._pending
                self._pending = ""
                return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._state == "call":  # cut off inside a call: a call if it parses
            call = _call(self._pending)
            if call is None or not self.offers(call.name):
                out.content += CALL_BEGIN + self._pending
            else:
                out.tool_calls.append(call)
        elif self._state in ("content", "after"):
            out.content += self._pending
        self._pending, self._state = "", "content"
        return out


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """R1's output: its chat template opens ``<think>`` in the prompt, so the output usually starts inside the
    reasoning (an opening ``<think>`` is accepted too) and ``</think>`` ends it; without one, all is reasoning."""

    name = "deepseek_r1"

    def __init__(self) -> None:
        super().__init__()
        self._state = "open"

    def feed(self, text: str) -> ParsedDelta:
        if self._state == "open":
            self._pending += text
            head = self._pending.lstrip()
            if head and THINK_START.startswith(head) and head != THINK_START:
                return ParsedDelta()  # could still be the opening tag
            self._pending = head.removeprefix(THINK_START)
            self._state, text = "reasoning", ""
        return super().feed(text)

    def finish(self) -> ParsedDelta:
        if self._state == "open":
            self._state = "reasoning"
        return super().finish()

