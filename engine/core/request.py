"""Request state as the scheduler sees it (plain Python, no torch)."""

import enum
import time

from engine.core.prompt_images import PromptImage
from engine.core.request_policy import DEFAULT_POLICY, RequestPolicy
from engine.core.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # its output could not be produced (e.g. detokenization failed); others go on

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


PROMOTED = -1  # ``Request.priority`` of a request promoted for having starved: more urgent than any class


class Request:
    """One sequence: its tokens so far and how many of them have KV in the cache.

    ``num_computed_tokens`` < ``num_tokens`` means there is work to schedule;
    prefill, chunked prefill, decode and recompute after preemption are all
    that one difference.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "output_token_ids", "all_token_ids", "sampling_params",
        "eos_token_id", "arrival_time", "status", "num_computed_tokens", "num_cached_tokens",
        "max_tokens", "policy", "num_preemptions", "stop_reason", "admit_seq", "num_charged_prompt_tokens",
        "first_scheduled_time", "parent_id", "index", "spec_acceptance", "spec_idle_steps", "output_invalid",
        "images", "encoded_images", "encoder_blocks", "priority", "idle_since",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        policy: RequestPolicy = DEFAULT_POLICY,
        parent_id: str | None = None,
        index: int = 0,
        images: tuple[PromptImage, ...] = (),
    ) -> None:
        """``parent_id`` and ``index``: this is choice ``index`` of the ``n`` copies of request ``parent_id``
        (its outputs carry that id and index). ``policy``: its priority class, tenant, fair-share weight,
        preemption, background and prefix-cache salt (``RequestPolicy``). ``images``: the pictures whose
        placeholder tokens the prompt holds (already expanded to one token per image token), in prompt order."""
        assert prompt_token_ids, "a request needs at least one prompt token"
        assert max_tokens >= 1
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        self.eos_token_id = eos_token_id
        self.policy = policy
        self.images = tuple(images)
        # Indices of the images a scheduled chunk has touched, so handed to the vision tower (or found in its cache)
        # for this request: the scheduler charges the encoder budget once per image, as the model keeps the
        # features until the request finishes (through preemption too).
        self.encoded_images: set[int] = set()
        # Layer-chunked encoding (``engine.core.encoder_pieces``): tower passes run so far per image not yet encoded.
        self.encoder_blocks: dict[int, int] = {}
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # The class the scheduler serves it in: its policy's, until it has gone unserved for the starvation bound
        # (``SchedulerConfig.starvation_bound_s``); then ``PROMOTED``, ahead of every class, until it ends.
        self.priority = policy.priority
        self.idle_since = self.arrival_time  # when last served, queued or preempted (set on the scheduler's clock)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first scheduling; -1 until then
        self.first_scheduled_time: float | None = None  # when it first left the waiting queue (queue time)
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.admit_seq = -1  # order of (re)admission: the most recently started is preempted first
        self.num_charged_prompt_tokens = 0  # prompt tokens already billed to the tenant's fair-share counter
        self.parent_id = parent_id
        self.index = index
        self.spec_acceptance = 1.0  # moving average of accepted / proposed drafts (engine.core.speculation)
        self.spec_idle_steps = 0  # steps without proposing since its acceptance fell below the threshold
        # Its grammar refused a token before the output was complete (``GrammarMatchers.accept``): it ends with
        # finish reason "error", never as a normal stop with text that breaks its format.
        self.output_invalid = False

    @property
    def output_id(self) -> str:
        """The request id its outputs carry: the caller's id, shared by the copies of an ``n`` > 1 request."""
        return self.parent_id if self.parent_id is not None else self.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output tokens past the first ``num_output_tokens`` (a speculative step that emitted several
        tokens of which an earlier one completed a stop string)."""
        extra = self.num_output_tokens - num_output_tokens
        if extra > 0:
            del self.output_token_ids[num_output_tokens:]
            del self.all_token_ids[len(self.all_token_ids) - extra:]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
