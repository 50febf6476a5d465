"""The model's vocabulary as the grammar library sees it: which tokens are text and which are special.

``llguidance.hf.from_tokenizer`` makes every added token of a Hugging Face tokenizer special, and its forced-text
shortcut tokenizes the text a grammar requires with the tokenizer's own ``encode``, which reads added tokens'
spellings as those tokens. So where a grammar needs the text ``<tool_call>`` (an added token of the Qwen family)
the mask allowed the token ``<tool_call>``, which the grammar then refused as special: the request ended there,
its output cut and invalid. Here the tokens the tokenizer marks special (and ids past its vocabulary) stay
special, so a grammar can never produce them as text; every other token, non-special added ones included, is
the bytes it decodes to (a ``<tool_call>`` token is the text ``<tool_call>``, as the detokenizer writes it); and
text is tokenized with special tokens read as plain text.
"""

import llguidance
import llguidance.hf


class _Vocabulary:
    """What ``llguidance.TokenizerWrapper`` reads: each token's bytes, the special ids, EOS, and a tokenizer."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None) -> None:
        # The library's own reading of the tokenizer gives each token's bytes (byte-level BPE, SentencePiece, byte
        # fallback) and which ids it cannot map to text (padding past the tokenizer): those stay special.
        library = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_id)
        text_added = {i for i, t in tokenizer.added_tokens_decoder.items() if not t.special}
        self.tokens = [library.decode_bytes([i]) for i in range(vocab_size)]
        self.special_token_ids = [i for i in range(vocab_size)
                                  if library.is_special_token(i) and i not in text_added]
        self.eos_token_id = eos_token_id
        self.bos_token_id = None
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        """``text``'s token ids, special tokens' spellings read as text (the grammar's text is never a special
        token)."""
        return self._tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def grammar_tokenizer(tokenizer, vocab_size: int, eos_token_id: int | None) -> llguidance.LLTokenizer:
    """The grammar library's tokenizer for a Hugging Face fast ``tokenizer`` and the model's ``vocab_size`` (which
    may pad the tokenizer's: ids past it are never allowed)."""
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tokenizer, vocab_size, eos_token_id)),
                                  n_vocab=vocab_size, eos_token=eos_token_id)
