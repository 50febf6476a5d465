"""Speculative decoding's host side (plain Python, no torch): n-gram prompt-lookup proposals, which requests
may speculate, and when speculation switches itself off.

With the "draft" method the proposals come from a small draft model on the device: the scheduler reserves the
K rows (``DRAFT_PENDING`` tokens) and the runner fills them in before the step's forward
(``engine.worker.draft_model``).

A decoding request with a proposal is scheduled with 1 + K tokens: its last sampled token and K draft tokens,
as extra query rows of the same forward as the rest of the step. The runner samples a token at each of the
1 + K rows (``engine.sampling.sampler``) and keeps the drafts up to the first one the model did not sample, plus
the model's own token at that row (``accepted_prefix``); the scheduler rolls the rest back.

Proposals are cheap only when they are accepted; each costs K rows of compute. So a request stops proposing
when the exponential moving average of its acceptance (accepted / proposed, per step) falls below
``min_acceptance``, and tries again every ``PROBE_EVERY`` steps; and no request proposes while more than
``max_batch`` requests run (large decode batches are compute-bound: extra rows cost about as much as they save).
"""

from dataclasses import dataclass

from engine.core.request import Request

SPECULATIVE_METHODS = ("ngram", "draft")
DRAFT_PENDING = -1  # a draft row the draft model fills in before the forward (method "draft")
NGRAM_MAX = 3  # longest suffix looked up in the request's own tokens
NGRAM_MIN = 2  # shortest: a single repeated token proposes too often to pay
SEARCH_WINDOW = 2048  # most recent tokens searched (keeps the host cost per step bounded)
EMA_DECAY = 0.7  # weight of the past in the acceptance average (about the last 3 steps)
PROBE_EVERY = 16  # a request below min_acceptance proposes again after this many steps


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """``method``: "ngram" (prompt lookup: the tokens that followed the latest earlier occurrence of the
    request's last 3, else 2, tokens) or "draft" (greedy tokens of the draft model at ``model``, a checkpoint
    directory sharing the target's tokenizer). ``num_tokens``: K, drafts per step. ``max_batch``: no request proposes
    while more than this many run. ``min_acceptance``: a request whose recent acceptance is below it stops
    proposing (it probes again now and then)."""

    method: str
    num_tokens: int
    max_batch: int
    min_acceptance: float
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if (self.method == "draft") != (self.model is not None):
            raise ValueError("speculative_model (--speculative-model) is the draft checkpoint: it is needed with "
                             f"speculative='draft' and only then (speculative={self.method!r}, "
                             f"speculative_model={self.model!r})")
        if not 1 <= self.num_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in 1..16, got {self.num_tokens}")
        if self.max_batch < 1:
            raise ValueError(f"speculative_max_batch must be >= 1, got {self.max_batch}")
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError(f"speculative_min_acceptance must be in [0, 1], got {self.min_acceptance}")


def ngram_proposal(tokens: list[int], k: int, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest suffix of ``tokens``
    (``n_max`` down to ``n_min`` tokens long) in the last ``SEARCH_WINDOW`` tokens; [] if none occurs."""
    length = len(tokens)
    # Reversed, the suffix is a prefix and the latest earlier occurrence is the first match at j >= 1; list.index
    # walks the candidates in C (a 2048-token context costs microseconds, not a Python loop over every token).
    rev = tokens[max(0, length - SEARCH_WINDOW):][::-1]
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        pattern = rev[:n]
        j = 1
        while j + n <= len(rev):
            try:
                j = rev.index(pattern[0], j, len(rev) - n + 1)
            except ValueError:
                break
            if rev[j:j + n] == pattern:
                return tokens[length - j:length - j + k]
            j += 1
    return []


def may_speculate(request: Request) -> bool:
    """Requests whose sampling depends on more than each row's logits do not speculate: logprobs, penalties and
    logit_bias, structured output, and min_tokens not reached yet (its stop-token ban depends on the position)."""
    p = request.sampling_params
    return not p.needs_each_token_on_host and request.num_output_tokens >= p.min_tokens


def accepted_prefix(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a speculative step emits: ``sampled`` [1 + K] holds the model's token at each row (row j follows
    draft j - 1); drafts are kept while the model sampled them, then the model's token at the first miss (or
    at the last row, when every draft was kept) ends the run."""
    emitted = []
    for draft, token in zip(drafts, sampled):
        emitted.append(token)
        if token != draft:
            return emitted
    emitted.append(sampled[len(drafts)])
    return emitted


class Speculator:
    """Proposes drafts for the scheduler and tracks each request's acceptance."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len

    def propose(self, request: Request, num_running: int) -> list[int]:
        """Draft tokens for a decoding request this step ([] when it should not speculate)."""
        c = self.config
        if num_running > c.max_batch or not may_speculate(request):
            return []
        if request.spec_acceptance < c.min_acceptance:
            request.spec_idle_steps += 1
            if request.spec_idle_steps < PROBE_EVERY:
                return []
        # Room: the step emits up to K + 1 tokens, within max_tokens and the model's length.
        room = min(request.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens) - 1
        k = min(c.num_tokens, room)
        if k <= 0:
            return []
        if c.method == "draft":
            return [DRAFT_PENDING] * k
        return ngram_proposal(request.all_token_ids, k)

    @staticmethod
    def record(request: Request, num_drafts: int, num_accepted: int) -> None:
        """Fold one step's acceptance into the request's moving average."""
        request.spec_acceptance = EMA_DECAY * request.spec_acceptance + (1 - EMA_DECAY) * num_accepted / num_drafts
        request.spec_idle_steps = 0
