"""Tokenizer loading and incremental detokenization."""

import logging
import os
import re

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_BYTE_FALLBACK_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a byte as Llama's and Mixtral's tokenizers spell it


def load_tokenizer(path: str):
    """A transformers fast tokenizer from local files, or None if the directory has none."""
    if not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        logger.info("%s: no tokenizer files; only token-id prompts can be served", path)
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # a broken tokenizer is reported, not fatal: token ids still work
        logger.warning("%s: tokenizer could not be loaded (%s); only token-id prompts can be served", path, str(e).splitlines()[0])
        return None


def check_vocabulary(tokenizer, vocab_size: int, tokenizer_dir: str) -> None:
    """ValueError unless every token id of ``tokenizer`` is a row of the model's ``vocab_size`` (a random-weight
    model's spec may give fewer than the tokenizer it borrows)."""
    if tokenizer is not None and len(tokenizer) > vocab_size:
        raise ValueError(f"the model's vocabulary has {vocab_size} tokens but the tokenizer in {tokenizer_dir} has "
                         f"{len(tokenizer)}: give the model at least {len(tokenizer)} (with --random-weights, "
                         f"vocab_size={len(tokenizer)} in its spec)")


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting a character.

    Decodes a short window (from ``prefix_offset``) and emits only what extends
    past the previously read text; a window ending in U+FFFD is a multi-byte
    character still incomplete, so nothing is emitted until it completes, and
    ``flush`` gives what is left at the end. The deltas and the flush add up to
    ``decode(context + output)[len(decode(context)):]``: for a byte-level BPE,
    ``decode(output)``.

    A few prompt tokens (the context) seed the window so leading-space rules see
    context. The context ends where the prompt's text is settled, before a trailing
    byte-fallback run or incomplete character (a token-id prompt can end inside
    one): the prompt keeps those bytes, so the output's first bytes decode as the
    output's, as they do decoded alone, and are not joined to the prompt's into a
    character that is neither's.

    Not exact: byte fallback decodes a run of byte tokens all or nothing, so a
    stray byte token right after a complete character spelled in byte tokens turns
    the whole run (already emitted) into U+FFFD in a whole decode. Holding every
    byte run back until it ends would delay such text for well-formed output.
    """

    _CONTEXT_TOKENS = 4

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # The context's end: before a trailing run of byte-fallback tokens (byte fallback decodes a run all
        # or nothing, so the output's first bytes would join it) and before the bytes of a character the
        # prompt leaves incomplete (a byte-level BPE's); a prompt ending in too many of them gets no context.
        end = len(prompt_token_ids)
        lowest = max(end - 64, 0)
        while end > 0 and self._is_byte_token(prompt_token_ids[end - 1]):
            end = end - 1 if end > lowest else 0
        lowest = max(end - 8, 0)
        while end > 0 and self._decode(prompt_token_ids[max(end - self._CONTEXT_TOKENS, 0):end]).endswith("\ufffd"):
            end = end - 1 if end > lowest else 0
        # Its start: byte-fallback tokenizers turn a run of bytes with a bad start into U+FFFD: move the
        # start back (a few tokens at most) until it no longer begins mid-character.
        start = max(end - self._CONTEXT_TOKENS, 0)
        lowest = max(end - self._CONTEXT_TOKENS - 4, 0)
        while start > lowest and self._decode(prompt_token_ids[start:end]).startswith("\ufffd"):
            start -= 1
        self.ids = list(prompt_token_ids[start:end])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     spaces_between_special_tokens=self.spaces_between_special_tokens)

    def _is_byte_token(self, token_id: int) -> bool:
        token = self.tokenizer.convert_ids_to_tokens(token_id)
        return isinstance(token, str) and _BYTE_FALLBACK_TOKEN.fullmatch(token) is not None

    def add(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full_text[len(prefix_text):]

    def flush(self) -> str:
        """At the end: whatever is still held back (an incomplete character shows as U+FFFD)."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full_text[len(prefix_text):]
