"""gpt-oss's harmony format: the output is a run of messages, each a header then a body.

    <|channel|>analysis<|message|>...reasoning...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>...the answer...<|return|>

The ``analysis`` channel is reasoning (``reasoning_content``); ``final`` is content; ``commentary`` addressed
``to=functions.NAME`` is a tool call whose body is its JSON arguments, and ``commentary`` without a recipient (a
preamble the model writes for the user) is content. The markers are special tokens, so they must be kept when
detokenizing (``needs_special_tokens``).

Parsed here from the text, with no tokenizer: the ``openai-harmony`` package parses the same format from token ids,
but it needs the o200k vocabulary file, which it downloads at first use; an offline server cannot rely on that.
"""

import json
import re

from gateway.tool_parsers.base import ParsedDelta, ToolCall, ToolParser, held_prefix

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
TERMINATORS = ("<|end|>", "<|return|>", "<|call|>", START)  # a message ends at one, or where the next begins
_HEADER_OPENINGS = ("<|", "to=")
MAX_HEADER = 512  # characters: longer without <|message|> is not a header (the text is then content)
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class HarmonyParser(ToolParser):
    """Streaming parser of harmony messages; reasoning, content and tool calls at once (so it serves as both
    the tool-call and the reasoning parser of a gpt-oss chat). With ``reads_calls`` off (a chat that offered
    no tools) a call's body stays in the content, as the model wrote it."""

    name = "harmony"
    needs_special_tokens = True

    def __init__(self, reads_calls: bool = True) -> None:
        self.reads_calls = reads_calls
        self._pending = ""
        self._in_body = False
        self._kind = "content"  # the current body's destination: "reasoning", "content" or "call"
        self._recipient = ""

    def feed(self, text: str) -> ParsedDelta:
        self._pending += text
        out = ParsedDelta()
        while self._step(out, at_end=False):
            pass
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        while self._step(out, at_end=True):
            pass
        if self._in_body:
            self._close(self._pending, out)
        elif self._pending.strip():  # a header that never got its <|message|>: text after all
            out.content += self._pending
        self._pending, self._in_body = "", False
        return out

    def _step(self, out: ParsedDelta, at_end: bool) -> bool:
        """Consume what can be decided now; True if more may follow in the pending text."""
        if not self._in_body:
            return self._header(out)
        end, marker = _first(self._pending, TERMINATORS)
        if end >= 0:
            self._close(self._pending[:end], out)
            # <|start|> opens the next header: keep it there; the others are consumed.
            self._pending = self._pending[end + (0 if marker == START else len(marker)):]
            self._in_body = False
            return True
        if self._kind != "call" and not at_end:  # stream the body, holding back what may begin a terminator
            keep = max(held_prefix(self._pending, m) for m in TERMINATORS)
            self._emit(self._pending[:len(self._pending) - keep], out)
            self._pending = self._pending[len(self._pending) - keep:]
        return False

    def _header(self, out: ParsedDelta) -> bool:
        head = self._pending.lstrip()
        # A header opens with a marker, or with its recipient when the prompt already wrote <|start|>assistant.
        if head and not any(head.startswith(o) or o.startswith(head) for o in _HEADER_OPENINGS):
            # Plain text where a header should be (a model that answers directly): content until a terminator.
            self._in_body, self._kind, self._recipient = True, "content", ""
            self._pending = head
            return True
        at = self._pending.find(MESSAGE)
        if at < 0:
            if len(self._pending) > MAX_HEADER:
                self._in_body, self._kind, self._recipient = True, "content", ""
                return True
            return False
        header, self._pending = self._pending[:at], self._pending[at + len(MESSAGE):]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self._recipient = recipient.group(1) if recipient else ""
        if self._recipient:
            self._kind = "call"
        else:
            self._kind = "reasoning" if channel and channel.group(1) == "analysis" else "content"
        self._in_body = True
        return True

    def _emit(self, text: str, out: ParsedDelta) -> None:
        if self._kind == "reasoning":
            out.reasoning += text
        else:
            out.content += text

    def _close(self, body: str, out: ParsedDelta) -> None:
        if self._kind != "call":
            self._emit(body, out)
            return
        name = self._recipient.removeprefix("functions.")
        try:
            args = json.loads(body)
        except ValueError:
            args = None
        if not isinstance(args, dict) or not name or not self.reads_calls:  # the text stays, as written
            out.content += body
            return
        out.tool_calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """(index, marker) of the earliest of ``markers`` in ``text``, or (-1, "")."""
    found = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(found) if found else (-1, "")
