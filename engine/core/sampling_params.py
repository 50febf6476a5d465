"""Per-request sampling and stopping settings: one definition for the offline API, the wire and the engine."""

import msgspec

from engine.core.structured_output_spec import StructuredOutput

MAX_LOGPROBS = 20  # most likely tokens reported per position (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit)


MAX_N = 128  # copies of one prompt a request may ask for (each holds a sequence slot and its own KV tail)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to pick tokens and when to stop.

    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` turn those
    filters off. ``seed`` makes one request's samples reproducible whatever else
    shares its batch. ``n`` copies of the prompt are generated as choices
    0..n-1 sharing the prompt's KV (``engine.core.parallel_sampling``); with a
    seed, choice i draws from its own seed derived from it. ``stop`` strings end generation and are not included in
    the returned text (``include_stop_str_in_output`` keeps them, and the text of the stop token or EOS that
    ended it); ``stop_token_ids`` end it too (the token is kept in ``token_ids`` and its text dropped, as for
    EOS). ``skip_special_tokens`` and ``spaces_between_special_tokens`` are passed to the tokenizer's decode
    (fast tokenizers join special tokens without spaces whatever the latter says).

    The same struct crosses the pipe to the engine process (msgpack); it is
    validated when built and again when decoded there.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_p: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in 1..{MAX_N}, got {self.n!r}")
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or s == "" for s in stops):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        self.stop = stops
        ids = list(self.stop_token_ids or [])
        if any(not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        self.stop_token_ids = ids
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (0.0 < self.repetition_penalty <= 1e4):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS or any(not isinstance(t, int) or t < 0 or not -100.0 <= b <= 100.0
                                             for t, b in bias.items()):
            raise ValueError(f"logit_bias takes up to {MAX_LOGIT_BIAS} token ids, each with a value in [-100, 100]")
        self.logit_bias = {int(t): float(b) for t, b in bias.items()} or None
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")

    @property
    def stop_strings(self) -> list[str]:
        return self.stop

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or logit_bias change this request's logits (the sampler's slower path)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias))

    @property
    def needs_each_token_on_host(self) -> bool:
        """Sampling or reporting this request's next token needs the host to have seen the one before:
        logprobs and prompt logprobs are read with each token, penalties and logit_bias read the token
        history, a grammar advances per token. Such a request does not speculate (overlapped steps handle
        each of these: ``engine.worker.overlap``)."""
        return (self.logprobs is not None or self.prompt_logprobs is not None or self.adjusts_logits
                or self.structured_output is not None)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
