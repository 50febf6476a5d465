"""The ``openai-harmony`` encoding of gpt-oss, loaded offline: its vocabulary file written from the served model's
own tokenizer.

The package reads o200k_base's ranks from ``o200k_base.tiktoken`` (one ``base64(token bytes) rank`` line per
token), which it downloads unless ``TIKTOKEN_ENCODINGS_BASE`` names a directory holding the file, and it checks the
file's SHA-256 either way. A gpt-oss checkpoint's ``tokenizer.json`` holds the same 199,998 ranks as a byte-level
BPE vocabulary (then harmony's special tokens), so the file is rebuilt from it into a cache directory and the
variable pointed there, unless the user set it. A tokenizer that is not o200k gives the file another hash, and a
one-line ``HarmonyVocabError``.
"""

import base64
import hashlib
import os
import tempfile
import threading
from pathlib import Path

ENV_VAR = "TIKTOKEN_ENCODINGS_BASE"
CACHE_ENV_VAR = "MOEGATE_CACHE_DIR"  # where the file is written (default ~/.cache/moegate)
FILE_NAME = "o200k_base.tiktoken"
NUM_RANKS = 199_998  # o200k_base's ordinary tokens; harmony's special tokens follow them
SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # what openai-harmony checks

_lock = threading.Lock()
_encoding = None  # the loaded HarmonyEncoding (one per process: the vocabulary is the same for every gpt-oss)


class HarmonyVocabError(RuntimeError):
    """The served model's tokenizer cannot give harmony its vocabulary (the message is one line for the user)."""


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV_VAR) or Path.home() / ".cache" / "moegate") / "tiktoken"


def tiktoken_file_bytes(tokenizer) -> bytes:
    """``o200k_base.tiktoken``'s content rebuilt from a byte-level BPE tokenizer (transformers' fast tokenizer or
    a ``tokenizers.Tokenizer``): ranks 0..199,997 in order, each ``base64(bytes) rank``; HarmonyVocabError if the
    tokenizer lacks one of them or is not byte-level."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not hasattr(backend, "get_vocab"):
        raise HarmonyVocabError("the model's tokenizer is not a fast (tokenizer.json) tokenizer; harmony needs the "
                                "o200k vocabulary of gpt-oss's tokenizer.json")
    vocab = backend.get_vocab(with_added_tokens=False)  # {byte-level string: id}
    by_rank: list[str | None] = [None] * NUM_RANKS
    for text, rank in vocab.items():
        if rank < NUM_RANKS:
            by_rank[rank] = text
    missing = sum(t is None for t in by_rank)
    if missing:
        raise HarmonyVocabError(f"the model's tokenizer is not the o200k vocabulary harmony needs ({missing:,} of "
                                f"its first {NUM_RANKS:,} ids are not ordinary tokens); serve gpt-oss's own tokenizer")
    to_byte = {ch: b for b, ch in bytes_to_unicode().items()}
    lines = []
    for rank, text in enumerate(by_rank):
        try:
            raw = bytes(to_byte[ch] for ch in text)
        except KeyError:
            raise HarmonyVocabError("the model's tokenizer is not a byte-level BPE vocabulary, so it is not the o200k "
                                    "vocabulary harmony needs; serve gpt-oss's own tokenizer") from None
        lines.append(base64.b64encode(raw) + b" " + str(rank).encode())
    return b"\n".join(lines) + b"\n"


def write_vocab_file(tokenizer, directory: Path) -> Path:
    """``directory/o200k_base.tiktoken`` from ``tokenizer`` (kept if a file with the expected hash is there),
    written atomically; HarmonyVocabError if the tokenizer's vocabulary is not o200k_base's."""
    path = directory / FILE_NAME
    if path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == SHA256:
        return path
    data = tiktoken_file_bytes(tokenizer)
    if hashlib.sha256(data).hexdigest() != SHA256:
        raise HarmonyVocabError("the model's tokenizer is not the o200k vocabulary harmony needs (its ranks differ "
                                "from o200k_base's); serve gpt-oss's own tokenizer")
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=FILE_NAME, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # readers see the old file or the whole new one
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def harmony_encoding(tokenizer=None, cache_dir: Path | None = None):
    """gpt-oss's ``HarmonyEncoding``, loaded once per process. The first call needs ``tokenizer`` (the served
    model's) to write the vocabulary file, unless ``TIKTOKEN_ENCODINGS_BASE`` is set; later calls return the same
    encoding."""
    global _encoding
    with _lock:
        if _encoding is not None:
            return _encoding
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding

        if not os.environ.get(ENV_VAR):
            if tokenizer is None:
                raise HarmonyVocabError("harmony's vocabulary is not loaded yet: it is written from the served "
                                        "model's tokenizer when the first chat is rendered")
            os.environ[ENV_VAR] = str(write_vocab_file(tokenizer, cache_dir or default_cache_dir()).parent)
        try:
            _encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
        except Exception as e:  # the package's error for a missing or altered file, as one line
            raise HarmonyVocabError(f"openai-harmony could not load {FILE_NAME} from {ENV_VAR}="
                                    f"{os.environ[ENV_VAR]}: {str(e).splitlines()[0]}") from None
        return _encoding
