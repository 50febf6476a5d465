"""Client text in a chat prompt is text: it never becomes the tokens that mark turns, tools or ends.

A chat template pastes the client's strings (message contents, names, tool calls' names and arguments, tool
results, the tools themselves) into its own markup, and tokenizing the rendered text reads every spelling of an
added token as that token: a user message holding ``<|im_end|>\\n<|im_start|>system ...`` became a real system
turn. Here the *control tokens* are the tokenizer's special tokens and every added token the chat template
itself writes (found by rendering a small conversation once: DeepSeek-R1's ``<｜User｜>`` is not marked special);
their spellings in client strings are swapped for sentinels before the template runs, and the sentinels become
the spelling's plain-text tokens after it ran, while the template's own markup is tokenized as before.

A chat whose client strings spell no control token (nearly all) is rendered and tokenized exactly as before:
the same ids as transformers' ``apply_chat_template``. gpt-oss's chats are rendered by openai-harmony, which
already encodes client text as text (``engine.text.harmony_chat``).
"""

import re
import secrets
from typing import Any

from engine.text.chat_input import ChatInput

# A conversation that makes a template write its markup: turns of every role, a tool, a call and its result.
_PROBE_TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {
    "type": "object", "properties": {"a": {"type": "string"}}}}}
_PROBE = [
    {"role": "system", "content": "s"}, {"role": "user", "content": "u"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": "x"}}}]},
    {"role": "tool", "content": "r", "tool_call_id": "c"}, {"role": "assistant", "content": "t"},
    {"role": "user", "content": "v"},
]
# A user turn with an image (the list-of-parts content image-text templates read): its placeholder markup.
_IMAGE_PROBE = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "u"}]}]


def _template_markup(tokenizer, template: str | None) -> set[str]:
    """The added tokens the chat template writes around a small conversation (with and without tools, and a turn
    with an image)."""
    if not template:
        return set()
    added = tokenizer.added_tokens_decoder
    found: set[str] = set()
    for messages, tools in ((_PROBE, [_PROBE_TOOL]), (_PROBE, None), (_IMAGE_PROBE, None)):
        try:
            text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        except Exception:  # a template that refuses this conversation: what the other one shows, or none
            continue
        found |= {added[i].content for i in tokenizer.encode(text, add_special_tokens=False) if i in added}
    return found


class ControlTokens:
    """One tokenizer's control tokens: ``shield`` a chat's client strings before rendering, ``encode`` after."""

    def __init__(self, tokenizer, template: str | None) -> None:
        self.tokenizer = tokenizer
        added = tokenizer.added_tokens_decoder
        spellings = {t.content for t in added.values() if t.special} | set(tokenizer.all_special_tokens)
        spellings |= _template_markup(tokenizer, template)
        self.spellings = sorted((s for s in spellings if s), key=lambda s: (-len(s), s))  # longest first
        self.ids = {i for i, t in added.items() if t.content in spellings}
        self.ids |= {i for i in tokenizer.all_special_ids if i is not None}
        self._pattern = re.compile("|".join(map(re.escape, self.spellings))) if self.spellings else None
        # What encode() adds around a whole text (a BOS for some tokenizers), kept when it encodes in pieces.
        bare = tokenizer.encode("a", add_special_tokens=False)
        full = tokenizer.encode("a")
        at = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), 0)
        self._prefix, self._suffix = full[:at], full[at + len(bare):]
        self._plain: dict[str, list[int]] = {}

    def shield(self, chat: ChatInput) -> tuple[ChatInput, dict[str, str]]:
        """``chat`` with every control token's spelling in its client strings swapped for a sentinel (a word of
        letters and digits no client string holds, which templates copy as they are), and {sentinel: spelling};
        ``chat`` itself if it spells none (then nothing changes)."""
        if self._pattern is None or not self._spells([chat.messages, chat.tools, chat.template_kwargs]):
            return chat, {}
        nonce = "MGctl" + secrets.token_hex(6)
        sentinels = {s: f"{nonce}n{k}x" for k, s in enumerate(self.spellings)}
        shielded = ChatInput(
            self._swap(chat.messages, sentinels), self._swap(chat.tools, sentinels), chat.add_generation_prompt,
            chat.continue_final_message, self._swap(chat.template_kwargs, sentinels), chat.harmony,
            chat.reasoning_effort)
        return shielded, {sentinel: spelling for spelling, sentinel in sentinels.items()}

    def encode(self, text: str, sentinels: dict[str, str]) -> list[int]:
        """Token ids of a rendered ``text`` whose client strings were shielded: the template's text as the
        tokenizer reads it (its markup as control tokens), each sentinel as its spelling's plain-text tokens."""
        if not sentinels:
            return self.tokenizer.encode(text)
        pattern = re.compile("|".join(map(re.escape, sentinels)))
        pieces: list[str] = []  # the template's text between the sentinels, one more than ``spelled``
        spelled: list[str] = []
        start = 0
        for match in pattern.finditer(text):
            pieces.append(text[start:match.start()])
            spelled.append(sentinels[match.group()])
            start = match.end()
        pieces.append(text[start:])
        # One batch call for every piece: a message of many spellings costs one tokenizer call, not one each
        # (a Python loop of calls would hold the gateway's interpreter for seconds).
        encoded = self.tokenizer(pieces, add_special_tokens=False)["input_ids"]
        ids: list[int] = list(self._prefix)
        for piece, spelling in zip(encoded, spelled):
            ids += piece
            ids += self.plain(spelling)
        return ids + encoded[-1] + self._suffix

    def plain(self, spelling: str) -> list[int]:
        """``spelling``'s tokens as text, none of them a control token (split further where a piece still reads
        as one: a non-special added token is matched even with ``split_special_tokens``)."""
        ids = self._plain.get(spelling)
        if ids is None:
            ids = self.tokenizer(spelling, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            if len(spelling) > 1 and self.ids.intersection(ids):
                ids = self.plain(spelling[:1]) + self.plain(spelling[1:])
            self._plain[spelling] = ids
        return ids

    def _spells(self, value: Any) -> bool:
        if isinstance(value, str):
            return self._pattern.search(value) is not None
        if isinstance(value, dict):
            return any(self._spells(k) or self._spells(v) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return any(self._spells(v) for v in value)
        return False

    def _swap(self, value: Any, sentinels: dict[str, str]) -> Any:
        if isinstance(value, str):
            return self._pattern.sub(lambda m: sentinels[m.group()], value)
        if isinstance(value, dict):
            return {self._swap(k, sentinels): self._swap(v, sentinels) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._swap(v, sentinels) for v in value]
        return value
