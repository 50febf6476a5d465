"""Continuous-batching scheduler: which requests run this step, and how many tokens each.

Plain Python, no torch. One step is ``schedule()`` then (after the runner)
``update()``. There is no prefill or decode phase: each request has
``num_computed_tokens`` and ``num_tokens`` and gets up to the difference
within the step's token budget.
"""

from collections import deque
from dataclasses import dataclass, field

from engine.config import CacheConfig, SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens to compute this step, starting at num_computed_tokens
    block_ids: list[int]
    sample: bool  # this chunk reaches the end of the known tokens, so a token is sampled


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # ended since the last step: runner drops their state

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class RequestUpdate:
    """What one step did to one request, for the output processor."""

    request: Request
    new_token_ids: list[int]
    finished: bool


class Scheduler:
    """Owns the waiting queue, the running list and the KV cache manager.

    Running requests are served first, in admission order; when blocks run out
    the most recently admitted running request is preempted (recompute: its
    blocks are freed, its full blocks stay in the prefix cache). Waiting
    requests are admitted in arrival order while budget, sequence slots and
    blocks allow; a step that preempted admits nobody new.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        self.config = scheduler_config
        self.kv = KVCacheManager(cache_config.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_last_step: list[str] = []
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------
    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        max_len = self.config.max_model_len
        assert request.num_tokens < max_len, "the engine rejects prompts that leave no room to generate"
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """End a request wherever it is and free its blocks; unknown ids are ignored."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish(self, request_id: str, status: RequestStatus) -> None:
        """End a request for a reason found outside the scheduler (a stop string)."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        assert status.is_finished
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
        del self.requests[request.request_id]
        self._finished_since_last_step.append(request.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step ---------------------------------------------------------
    def _preempt_last(self) -> Request:
        victim = self.running.pop()
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)  # it keeps its place ahead of later arrivals
        return victim

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            assert num_new > 0, "a running request always has a token to compute"
            while not self.kv.allocate_slots(request, num_new):
                victim = self._preempt_last()
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
                i += 1
                continue
            break  # the request itself was preempted: nothing after it can run either

        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            cached = self.kv.find_cached_prefix(request)
            num_cached = len(cached) * self.kv.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(request, num_new, cached):
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new

        finished = self._finished_since_last_step
        self._finished_since_last_step = []
        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            preempted_ids=preempted,
            finished_ids=finished,
        )

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        sample = request.num_computed_tokens + num_new == request.num_tokens
        return ScheduledRequest(request, num_new, self.kv.block_ids(request.request_id), sample)

    def update(self, sched_out: SchedulerOutput, sampled_token_ids: list[int | None]) -> list[RequestUpdate]:
        """Advance computed counts, append sampled tokens, finish and free what is done.

        ``sampled_token_ids`` is aligned with ``sched_out.scheduled``; None where
        the chunk did not reach the end of the request (nothing sampled).
        """
        assert len(sampled_token_ids) == len(sched_out.scheduled)
        updates: list[RequestUpdate] = []
        for item, token in zip(sched_out.scheduled, sampled_token_ids):
            request = item.request
            if request.status != RequestStatus.RUNNING:
                continue  # aborted between schedule() and update()
            request.num_computed_tokens += item.num_new_tokens
            self.kv.cache_computed_blocks(request)
            if not item.sample:
                continue
            assert token is not None
            request.append_output_token(token)
            status = self._stop_status(request, token)
            if status is not None:
                self._finish(request, status)
            updates.append(RequestUpdate(request, [token], status is not None))
        return updates

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token == request.eos_token_id and not params.ignore_eos:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
