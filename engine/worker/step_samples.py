"""What one step sampled, as the runner hands it to the engine loop (and the pipeline's stage 0 to rank 0)."""

from dataclasses import dataclass, field

from engine.core.logprob_outputs import Logprobs


@dataclass(slots=True)
class StepSamples:
    """What a step sampled: a token per scheduled request (None where it did not sample), and the
    logprobs (by request id) of the requests that asked for them."""

    token_ids: list[int | list[int] | None]  # a part with K drafts: the token sampled at each of its K + 1 rows
    logprobs: dict[str, Logprobs] = field(default_factory=dict)
    # request id -> (position of its first entry, logprobs of the prompt tokens this step scored); position 0
    # (the first prompt token) is never scored: nothing precedes it.
    prompt_logprobs: dict[str, tuple[int, Logprobs]] = field(default_factory=dict)
