"""gpt-oss's output read by the ``openai-harmony`` package's ``StreamableParser``, token by token.

The output is a run of harmony messages (after the prompt's ``<|start|>assistant``)::

    <|channel|>analysis<|message|>...reasoning...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>...the answer...<|return|>

``analysis`` is reasoning (``reasoning_content``); ``final`` is content, and so is ``commentary`` without a
recipient (a preamble the model writes for the user); a message addressed ``to=functions.NAME`` is a tool call whose
body is its JSON arguments, returned once the message is whole. Reasoning and content stream as the tokens come.

Output that is not harmony is content from there on, as the engine detokenized it: text from its first token (a
model that answers off-format, JSON that a ``response_format`` grammar forces), or tokens the package refuses.
"""

from collections.abc import Sequence

from gateway.tool_parsers.base import ParsedDelta, ToolParser, call_from_json

FUNCTIONS = "functions."


class HarmonyParser(ToolParser):
    """Streaming parser of harmony messages from token ids: reasoning, content and tool calls at once (so it serves
    as both the tool-call and the reasoning parser of a gpt-oss chat). With ``reads_calls`` off (a chat that offered
    no tools) a call's body stays in the content, as the model wrote it."""

    name = "harmony"
    reads_tokens = True  # fed token ids (``feed_output``), not text

    def __init__(self, tools: list[dict] | None = None, reads_calls: bool = True) -> None:
        from openai_harmony import Role, StreamableParser

        from engine.text.harmony_vocab import harmony_encoding

        super().__init__(tools)
        self.reads_calls = reads_calls
        self._encoding = harmony_encoding()  # loaded when the request's prompt was rendered
        self._parser = StreamableParser(self._encoding, role=Role.ASSISTANT)
        self._ends = frozenset(self._encoding.stop_tokens())  # <|end|>, <|call|>, <|return|>: a message is whole
        self._done = 0  # messages of the parser already read
        self._header: list[int] = []  # tokens since the last message began its body or ended (a header, so far)
        self._off_format = False
        self._started = False  # a token of the output has been read

    def feed_output(self, text: str, token_ids: Sequence[int]) -> ParsedDelta:
        """One step's tokens (``text``: their detokenized text, used once the output is off-format)."""
        out = ParsedDelta()
        if self._off_format:
            out.content += text
            return out
        if not self._started and token_ids:
            self._started = True
            if not self._opens_header(token_ids[0]):  # plain text (or JSON a response_format forces): content,
                self._off_format = True  # streamed as it comes; ``text`` is all of the output so far
                out.content += text
                return out
        for i, token in enumerate(token_ids):
            try:
                self._parser.process(token)
            except Exception:  # HarmonyError: not harmony from here on
                out.content += self._encoding.decode(self._header + list(token_ids[i:]))
                self._off_format = True
                return out
            if token in self._ends:
                self._ended(out)
            else:
                self._stream(token, out)
        return out

    def _opens_header(self, token: int) -> bool:
        """Whether an output may start with ``token``: a marker (``<|channel|>``), or ``to=`` when the header
        names its recipient first."""
        return self._encoding.is_special_token(token) or self._encoding.decode([token]).strip() in ("to", "to=")

    def feed(self, text: str) -> ParsedDelta:
        raise TypeError("the harmony parser reads token ids: use feed_output")

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._off_format:
            return out
        try:
            self._parser.process_eos()  # a body cut off (max_tokens) ends its message
        except Exception:  # cut off inside a header
            pass
        self._ended(out)
        if self._header:  # a header that never got its <|message|>: text after all
            out.content += self._encoding.decode(self._header)
            self._header = []
        return out

    def _ended(self, out: ParsedDelta) -> None:
        """Read the messages the parser completed since the last call. (Only at a message's end: the package
        decodes every message, and its state every token so far, from JSON on each read.)"""
        messages = self._parser.messages
        if len(messages) == self._done:
            return
        for message in messages[self._done:]:
            self._close(message, out)
        self._done = len(messages)
        self._header = []

    def _stream(self, token: int, out: ParsedDelta) -> None:
        """The piece of the current body ``token`` wrote, or the token kept as part of a header."""
        parser = self._parser
        delta = parser.last_content_delta  # None in a header (and for a character's first bytes)
        if delta is None and parser.current_channel is None and parser.current_recipient is None:
            self._header.append(token)
            return
        self._header = []
        if delta and self._streams(parser.current_recipient):
            if parser.current_channel == "analysis":
                out.reasoning += delta
            else:
                out.content += delta

    def _streams(self, recipient: str | None) -> bool:
        """Whether a body addressed to ``recipient`` is text shown as it comes (not a call read when whole)."""
        return not recipient or (recipient.startswith(FUNCTIONS) and not self.reads_calls)

    def _close(self, message, out: ParsedDelta) -> None:
        """A whole message: a call's arguments are read now; text bodies were streamed already."""
        if self._streams(message.recipient):
            return
        body = "".join(getattr(part, "text", "") for part in message.content)
        call = None
        if message.recipient.startswith(FUNCTIONS):
            call = call_from_json({"name": message.recipient.removeprefix(FUNCTIONS), "arguments": body})
        if call is None or not self.offers(call.name):  # arguments that are not a JSON object, or a function
            # the request did not offer (or a tool this server does not run): the text
            out.content += body
            return
        out.tool_calls.append(call)
