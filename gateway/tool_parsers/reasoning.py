"""Reasoning in ``<think>...</think>`` (the Qwen3 family): moved out of the content into ``reasoning_content``.

An output that opens with ``<think>`` is reasoning until ``</think>`` (or its end, if it was cut off); the
rest, without the whitespace that follows the block, is content. An output that does not open with
``<think>`` (thinking switched off, or a model that answers directly) is all content.
"""

from gateway.tool_parsers.base import ParsedDelta, held_prefix

START, END = "<think>", "</think>"


class ThinkReasoningParser:
    name = "qwen3"

    def __init__(self) -> None:
        self._pending = ""
        self._state = "start"  # start -> reasoning -> after (whitespace skipped) -> content

    def feed(self, text: str) -> ParsedDelta:
        self._pending += text
        out = ParsedDelta()
        while True:
            if self._state == "start":
                head = self._pending.lstrip()
                if head.startswith(START):
                    self._pending, self._state = head[len(START):], "reasoning"
                    continue
                if head and START.startswith(head) or not head:
                    return out  # could still become <think>
                self._state = "content"
                continue
            if self._state == "reasoning":
                end = self._pending.find(END)
                if end >= 0:
                    out.reasoning += self._pending[:end]
                    self._pending, self._state = self._pending[end + len(END):], "after"
                    continue
                keep = held_prefix(self._pending, END)
                out.reasoning += self._pending[:len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep:]
                return out
            if self._state == "after":
                self._pending = self._pending.lstrip()
                if not self._pending:
                    return out
                self._state = "content"
            out.content += self._pending
            self._pending = ""
            return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._state == "reasoning":
            out.reasoning += self._pending
        elif self._state in ("start", "content"):
            out.content += self._pending
        self._pending = ""
        return out

    def parse(self, text: str) -> ParsedDelta:
        out = self.feed(text)
        out += self.finish()
        return out


class OpenThinkReasoningParser(ThinkReasoningParser):
    """MiniMax-M2: the chat template's generation prompt already opens ``<think>``, so the output starts as
    reasoning and runs to ``</think>``; the rest, without the whitespace after it, is content."""

    name = "minimax_m2"

    def __init__(self) -> None:
        super().__init__()
        self._state = "reasoning"
