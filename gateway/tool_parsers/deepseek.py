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

from gateway.tool_parsers.base import ParsedDelta, ToolCall, call_from_json
from gateway.tool_parsers.reasoning import START as THINK_START, ThinkReasoningParser
from gateway.tool_parsers.sections import SectionToolParser

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


class DeepSeekToolParser(SectionToolParser):
    name = "deepseek_v3"
    SECTION_BEGIN, SECTION_END, CALL_BEGIN, CALL_END = CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END

    def read_call(self, body: str) -> ToolCall | None:
        return _call(body)


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

