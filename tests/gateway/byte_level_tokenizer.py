"""The tokenizer the image chat tests save beside their tiny checkpoints: byte-level characters as tokens
(printable ASCII and byte-level's space and newline, ids 0-95, then ``<unk>``), the rest of the vocabulary filler,
the model's special tokens at the checkpoint's ids, and the model's chat template."""

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def write_byte_level_tokenizer(path: str, vocab_size: int, specials: dict[int, str], template: str,
                               **named: str) -> PreTrainedTokenizerFast:
    """Saved to ``path`` and returned; ``named``: the special tokens' roles (``eos_token="<|im_end|>"``)."""
    chars = [chr(c) for c in range(33, 127)] + ["\u0120", "\u010a"]  # byte-level's space and newline
    vocab = {c: i for i, c in enumerate(chars)}
    vocab["<unk>"] = len(vocab)
    for i in range(len(vocab), vocab_size):
        vocab[specials.get(i, f"<unused{i}>")] = i
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                                                 pre_tokenizers.Split("", behavior="isolated")])
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials.values()])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", chat_template=template, **named)
    tok.save_pretrained(path)
    return tok
