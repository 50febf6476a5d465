"""What each request asks: prompts and output lengths from synthetic distributions, ShareGPT files or shared prefixes.

Lengths are in tokens. Without a tokenizer, synthetic prompts are built from
common short English words, each about one token in BPE vocabularies, and
ShareGPT texts are sized at four characters a token; with ``tokenizer`` (a
``tokenizer.json`` file or a checkpoint directory holding one) prompts are cut
to the exact token count. Either way the report uses the token counts the
server returns in ``usage``; the dataset's own length is kept beside it.

Images (chat only, for a model that reads them): ``images`` image parts per request, each a random-pixel PNG
of one of ``image_size``'s sizes, sent inline as a ``data:`` URL. A share ``image_repeat`` of the parts is one
of a pool of ``image_pool`` images the tenant sends again and again (the server's encoder cache can serve them
after their first send); the rest are new images never sent before. Each request records how many of its
images were new, so the report can set the time to first token of requests with new images against those
whose images had all been sent before (``loadgen.metrics.image_ttft``).

Length distributions (``LengthDist.parse``): ``128`` or ``fixed:128``;
``uniform:16,512`` (inclusive); ``normal:256,64`` (mean, standard deviation;
rounded, at least 1); ``hist:16-64=3,64-512=1`` (bins ``LO-HI`` or single
values, each with a weight; uniform inside a bin).
"""

import base64
import json
import os
import random
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

KINDS = ("synthetic", "sharegpt", "shared-prefix")

# Short, common words: one token each in the usual BPE vocabularies (and in the demo model's).
_WORDS = (
    "the of and to in is was for on that with as by at from it his an were are which this be or had not "
    "but one all she he they there her their been has when who will more no out up into do so can two "
    "time first new may over some could these only other most also over down day make way year man old "
    "sea bread water river mill boat town house garden rain road hill tree bird light door room book"
).split()


@dataclass(slots=True)
class LengthDist:
    """A distribution of lengths in tokens (see the module docstring for the text form)."""

    kind: str = "fixed"
    a: float = 128
    b: float = 0
    bins: list[tuple[int, int, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "normal", "hist"):
            raise ValueError(f"unknown length distribution {self.kind!r}")
        if self.kind == "fixed" and self.a < 1:
            raise ValueError("a fixed length must be >= 1")
        if self.kind == "uniform" and not 1 <= self.a <= self.b:
            raise ValueError(f"uniform lengths need 1 <= low <= high, got {self.a:g},{self.b:g}")
        if self.kind == "normal" and (self.a < 1 or self.b < 0):
            raise ValueError("normal lengths need mean >= 1 and std >= 0")
        if self.kind == "hist":
            if not self.bins or any(lo < 1 or hi < lo or w < 0 for lo, hi, w in self.bins):
                raise ValueError("histogram bins need 1 <= LO <= HI and weights >= 0")
            if sum(w for _, _, w in self.bins) <= 0:
                raise ValueError("histogram weights must not all be 0")

    @classmethod
    def parse(cls, text: str | int) -> "LengthDist":
        if isinstance(text, int):
            return cls("fixed", text)
        text = str(text).strip()
        kind, _, args = text.partition(":") if ":" in text else ("fixed", "", text)
        try:
            if kind == "fixed":
                parsed = dict(kind="fixed", a=int(args))
            elif kind in ("uniform", "normal"):
                a, b = (float(x) for x in args.split(","))
                parsed = dict(kind=kind, a=a, b=b)
            elif kind == "hist":
                bins = []
                for part in args.split(","):
                    span, _, weight = part.partition("=")
                    lo, _, hi = span.partition("-")
                    bins.append((int(lo), int(hi or lo), float(weight or 1)))
                parsed = dict(kind="hist", bins=bins)
            else:
                parsed = None
        except ValueError:
            parsed = None
        if parsed is None:
            raise ValueError(f"bad length distribution {text!r}: use N, fixed:N, uniform:LO,HI, normal:MEAN,STD "
                             "or hist:LO-HI=W,...")
        return cls(**parsed)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        if self.kind == "normal":
            return max(1, round(rng.gauss(self.a, self.b)))
        lo, hi, _ = rng.choices(self.bins, weights=[w for _, _, w in self.bins])[0]
        return rng.randint(lo, hi)

    def mean(self) -> float:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        if self.kind == "normal":
            return self.a  # the clip at 1 moves it only for tiny means
        total = sum(w for _, _, w in self.bins)
        return sum(w * (lo + hi) / 2 for lo, hi, w in self.bins) / total


@dataclass(slots=True)
class RequestSpec:
    """One request's content. ``system`` is a shared prefix (a system message in chat, prepended otherwise)."""

    prompt: str
    input_len: int
    max_tokens: int
    system: str | None = None
    prefix_id: int | None = None
    images: tuple[str, ...] = ()  # data: URLs of the request's images (chat)
    new_images: int = 0  # of them, images this tenant had not sent before


@dataclass(slots=True)
class DatasetConfig:
    """Where prompts come from. Unused fields for a kind are ignored."""

    kind: str = "synthetic"
    input_len: str = "uniform:16,512"
    output_len: str = "uniform:8,256"
    path: str | None = None  # ShareGPT JSON file
    num_prefixes: int = 4  # shared-prefix: distinct system prompts
    prefix_len: int = 512  # shared-prefix: tokens in each system prompt
    tokenizer: str | None = None
    sharegpt_output_len: bool = True  # ShareGPT: max_tokens from the recorded reply (else output_len)
    images: int = 0  # image parts per request (chat only); 0: text only
    image_size: str = "448x448"  # WxH, or several separated by commas (each image draws one)
    image_repeat: float = 0.5  # share of the image parts drawn from a pool of images sent again
    image_pool: int = 8  # distinct images that repeat

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"dataset kind must be one of {KINDS}, got {self.kind!r}")
        self.input_len = str(self.input_len)
        self.output_len = str(self.output_len)
        LengthDist.parse(self.input_len)
        LengthDist.parse(self.output_len)
        if self.kind == "sharegpt" and not self.path:
            raise ValueError("the sharegpt dataset needs a path to a ShareGPT-format JSON file")
        if self.kind == "shared-prefix" and (self.num_prefixes < 1 or self.prefix_len < 1):
            raise ValueError("shared-prefix needs num_prefixes >= 1 and prefix_len >= 1")
        if self.images < 0:
            raise ValueError(f"images (per request) must be >= 0, got {self.images}")
        self.image_size = str(self.image_size)
        parse_image_sizes(self.image_size)
        if not 0 <= self.image_repeat <= 1:
            raise ValueError(f"image_repeat must be between 0 and 1, got {self.image_repeat:g}")
        if self.image_pool < 1:
            raise ValueError(f"image_pool must be >= 1, got {self.image_pool}")

    def describe(self) -> str:
        if self.kind == "sharegpt":
            return f"sharegpt {os.path.basename(self.path)}" + self._describe_images()
        if self.kind == "shared-prefix":
            return (f"shared-prefix {self.num_prefixes} x {self.prefix_len} tokens + suffix {self.input_len}, "
                    f"output {self.output_len}" + self._describe_images())
        return f"synthetic input {self.input_len}, output {self.output_len}" + self._describe_images()

    def _describe_images(self) -> str:
        if not self.images:
            return ""
        return (f"; {self.images} image(s) of {self.image_size}, {100 * self.image_repeat:g}% repeated from "
                f"{self.image_pool}")


def parse_image_sizes(text: str) -> list[tuple[int, int]]:
    """``448x448`` or ``224x224,640x480``: (width, height) pairs; ValueError for anything else."""
    sizes = []
    for part in str(text).split(","):
        w, _, h = part.strip().lower().partition("x")
        if not (w.isdigit() and h.isdigit() and int(w) > 0 and int(h) > 0):
            raise ValueError(f"image sizes are WxH separated by commas (e.g. 448x448,640x480), got {text!r}")
        sizes.append((int(w), int(h)))
    return sizes


def png_data_url(width: int, height: int, rng: random.Random) -> str:
    """A PNG of random pixels (RGB, 8 bits), as a ``data:`` URL: written here, no imaging library needed."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\0" + rng.randbytes(3 * width) for _ in range(height))  # filter 0 per row
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(rows, 1)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(png).decode()


class _Images:
    """One tenant's image parts: repeated ones from a pool (new the first time each is sent), and new ones."""

    def __init__(self, config: DatasetConfig, rng: random.Random) -> None:
        self.config, self.rng = config, rng
        self.sizes = parse_image_sizes(config.image_size)
        self.pool = [png_data_url(*rng.choice(self.sizes), rng) for _ in range(config.image_pool)]
        self.sent: set[int] = set()

    def draw(self) -> tuple[tuple[str, ...], int]:
        urls, new = [], 0
        for _ in range(self.config.images):
            if self.rng.random() < self.config.image_repeat:
                i = self.rng.randrange(len(self.pool))
                new += i not in self.sent
                self.sent.add(i)
                urls.append(self.pool[i])
            else:
                urls.append(png_data_url(*self.rng.choice(self.sizes), self.rng))
                new += 1
        return tuple(urls), new


class _Sizer:
    """Counts and cuts text in tokens: exactly with a tokenizer, else one word = one token / 4 chars = one token."""

    def __init__(self, tokenizer: str | None) -> None:
        self.tok = None
        if tokenizer:
            from tokenizers import Tokenizer

            path = os.path.join(tokenizer, "tokenizer.json") if os.path.isdir(tokenizer) else tokenizer
            if not os.path.isfile(path):
                raise ValueError(f"no tokenizer file at {path}")
            self.tok = Tokenizer.from_file(path)

    def words(self, n: int, rng: random.Random) -> str:
        text = " ".join(rng.choice(_WORDS) for _ in range(n))
        if self.tok is None:
            return text
        ids = self.tok.encode(text, add_special_tokens=False).ids
        while len(ids) < n:  # rare: a tokenizer that merges words
            text += " " + " ".join(rng.choice(_WORDS) for _ in range(n - len(ids)))
            ids = self.tok.encode(text, add_special_tokens=False).ids
        return self.tok.decode(ids[:n])

    def count(self, text: str) -> int:
        if self.tok is None:
            return max(1, round(len(text) / 4))
        return len(self.tok.encode(text, add_special_tokens=False).ids)


def load_sharegpt(path: str) -> list[tuple[str, str]]:
    """(first human turn, the reply to it) pairs from a ShareGPT-format JSON file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read ShareGPT file {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    pairs = []
    for item in data if isinstance(data, list) else []:
        if not isinstance(item, dict):
            continue
        turns = item.get("conversations") or item.get("messages") or []
        texts = [(t.get("from") or t.get("role"), t.get("value") or t.get("content")) for t in turns if isinstance(t, dict)]
        for (who, text), (who2, reply) in zip(texts, texts[1:]):
            if who in ("human", "user") and who2 in ("gpt", "assistant", "chatgpt") and text and reply:
                pairs.append((text, reply))
                break
    if not pairs:
        raise ValueError(f"{path} has no ShareGPT conversations (a list of {{'conversations': [human, gpt, ...]}})")
    return pairs


def iter_requests(config: DatasetConfig, seed: int) -> Iterator[RequestSpec]:
    """An endless, deterministic stream of requests for one tenant (with ``config.images`` images each)."""
    texts = _iter_texts(config, seed)
    if not config.images:
        yield from texts
        return
    images = _Images(config, random.Random(f"{seed}:images"))
    for spec in texts:
        spec.images, spec.new_images = images.draw()
        yield spec


def _iter_texts(config: DatasetConfig, seed: int) -> Iterator[RequestSpec]:
    rng = random.Random(seed)
    sizer = _Sizer(config.tokenizer)
    in_dist, out_dist = LengthDist.parse(config.input_len), LengthDist.parse(config.output_len)
    if config.kind == "synthetic":
        while True:
            n = in_dist.sample(rng)
            yield RequestSpec(sizer.words(n, rng), n, out_dist.sample(rng))
    elif config.kind == "shared-prefix":
        prefixes = [sizer.words(config.prefix_len, rng) for _ in range(config.num_prefixes)]
        while True:
            i = rng.randrange(config.num_prefixes)
            n = in_dist.sample(rng)
            yield RequestSpec(sizer.words(n, rng), config.prefix_len + n, out_dist.sample(rng), prefixes[i], i)
    else:
        pairs = load_sharegpt(config.path)
        order = list(range(len(pairs)))
        while True:
            rng.shuffle(order)  # each pass over the file in a new order
            for i in order:
                text, reply = pairs[i]
                out = sizer.count(reply) if config.sharegpt_output_len else out_dist.sample(rng)
                yield RequestSpec(text, sizer.count(text), out)
