"""The scheduler: which requests run this step, and how many tokens each.

Plain Python, no torch. One step is ``schedule()`` then (after the runner)
``update()``. There is no prefill or decode phase: each request has
``num_computed_tokens`` and ``num_tokens`` and gets up to the difference
within the step's token budget.

A step serves priority classes most urgent first (``RequestPolicy.priority``:
lower is more urgent). Within a class, running requests (in admission order)
come first, then waiting ones are admitted (fairly across tenants, see
``waiting_queue``). So less urgent work never takes
budget, sequence slots or blocks ahead of more urgent work:

- admission preemption: a waiting request that does not fit (no free blocks
  or ``max_num_seqs`` reached) preempts the least urgent, most recently
  admitted running request of a *less urgent* class that is ``preemptible``;
  requests of one class never preempt each other this way; a request whose
  policy gives a grace (``RequestPolicy.preempt_grace_ms``) first waits that
  long for room to free by itself;
- memory preemption: a running request that cannot grow preempts the
  least urgent, most recently admitted request not yet served this step
  (possibly itself). This one ignores ``preemptible``: without it the engine
  could stall with every block held.

Preemption is recompute: the victim's blocks are freed, its full blocks stay
in the prefix cache, and it waits first in its class. Starvation: a class is
served whenever every more urgent class's work fits in the step, and the running
requests of any class keep their blocks while they wait for budget, so batch
work advances whenever capacity is idle. Under a load that never leaves room, a
request unserved for ``starvation_bound_s`` (waiting, preempted, or running
without tokens) is promoted (``Request.priority`` becomes ``PROMOTED``): it is
served ahead of every class, background caps included, until it ends, and is
admitted into the next free slot and blocks; it preempts only what its own
class could have, and nothing can preempt it at admission.

Background work (``RequestPolicy.background``, the Batch API's lines, in their own
least urgent class) also yields step *time*, which matters where a step's duration
grows with its size (a CPU, a small GPU batch): a foreground request's first
token waits for the step in flight and then for its own prefill step. So a step
that prefills foreground work serves no background work at all, and while
foreground work is present or was recently (``background_window_s``), the
background gets at most ``background_token_budget`` tokens a step, which keeps
every step short. With no foreground traffic the background has whole steps.

Images (models that read them): the chunk that first holds one of an image's placeholder tokens has the vision
tower encode the whole image in that step. A step encodes at most ``max_num_encoder_tokens`` image tokens: a
chunk stops before the first image past that budget (the image waits for a later step), so a request with many
images is encoded over several steps while the running requests keep decoding. An image larger than the
budget is encoded alone in a step; one the encoder cache holds for the request's salt costs nothing. With
layer-chunked encoding (``max_num_encoder_token_blocks``, ``engine.core.encoder_pieces``) a step runs only some of
the tower's blocks for an image (``SchedulerOutput.encoder_pieces``), within that budget, and the chunk stops
before the image until the step that runs its last blocks. A chunk also stops before an image whose pixels are
still being preprocessed off the step loop (``image_ready``): the image waits for a later step.

Overlapped steps (``EngineConfig.overlap_scheduling``): the engine schedules
step N+1 before step N's tokens are read. ``advance()`` accounts for a launched
step at once (computed counts move on, and each request that samples gets a
``PLACEHOLDER`` token, which the runner feeds from the device), and
``resolve()`` applies the tokens one step later: it fills the placeholders and
runs the stop checks. A request whose in-flight token ends it by length is not
scheduled again; one that turns out stopped after it was scheduled into the
next step is finished at ``resolve()`` (its blocks freed), and that step's token
for it is dropped.
"""

import bisect
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.block_pool import Block
from engine.core.encoder_pieces import EncoderPiece, EncoderSteps
from engine.core.kv_cache_manager import CachedPrefix, KVCacheManager, PrefixTiers
from engine.core.lora_residency import LoraLoad, LoraResidency
from engine.core.prompt_images import PromptImage
from engine.core.request import PROMOTED, Request, RequestStatus
from engine.core.speculation import Speculator, accepted_prefix
from engine.core.state_checkpoints import StateCheckpoints
from engine.core.state_slots import StateSlots
from engine.core.stats import SchedulerStats
from engine.core.waiting_queue import VirtualTokenCounter, WaitingQueue

# A sampled token still on the device (overlapped steps): the last token of a request whose step is in flight.
PLACEHOLDER = -1


@dataclass(slots=True)
class ScheduledRequest:
    """One request's part of a step, as plain data: everything a rank needs to build the step's batch.

    ``request`` is the scheduler's own state (for sampling and updates); ranks that only run the
    model (tensor-parallel followers) get plans without it.
    """

    request: Request | None
    num_new_tokens: int
    block_ids: list[int]
    sample: bool  # this chunk reaches the end of the known tokens, so a token is sampled
    start: int = 0  # position of the first token to compute (the request's computed tokens so far)
    token_ids: list[int] = field(default_factory=list)  # the num_new_tokens tokens to compute
    # Prompt logprobs: the first this-many rows of the chunk score the prompt token that follows each of them.
    prompt_logprob_rows: int = 0
    # Speculative decoding: the last K of the num_new_tokens are drafts (not yet the request's tokens); the
    # step samples at each of the last K + 1 rows and keeps the drafts the model agrees with.
    draft_token_ids: list[int] = field(default_factory=list)
    # The block table of the sliding-window layers' cache group (the null block where blocks left the window),
    # as long as ``block_ids``; empty when every layer reads ``block_ids`` (one cache group).
    window_block_ids: list[int] = field(default_factory=list)
    # The LoRA adapter the part runs under (None: the base model), for ranks whose plans carry no ``request``.
    lora_adapter: str | None = None
    # Hybrid models: the request's slot in the state cache (``engine.core.state_slots``); -1: the model keeps none.
    state_slot: int = -1

    @classmethod
    def of(cls, request: Request, num_new_tokens: int, block_ids: list[int], sample: bool,
           drafts: list[int] | None = None, window_block_ids: list[int] | None = None,
           state_slot: int = -1) -> "ScheduledRequest":
        start = request.num_computed_tokens
        rows = 0
        if request.sampling_params.prompt_logprobs is not None:
            rows = max(0, min(start + num_new_tokens, request.num_prompt_tokens - 1) - start)
        drafts = drafts or []
        known = request.all_token_ids[start:start + num_new_tokens - len(drafts)]
        return cls(request, num_new_tokens, block_ids, sample, start, known + drafts, rows, drafts,
                   window_block_ids or [], state_slot=state_slot)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # ended since the last step: runner drops their state
    # Prefix-cache tiers, done by the runner before the forward, in this order: (block id, hash, tenant) of
    # cached blocks evicted from the pool by this plan (saved to host), then of host hits to copy into the
    # blocks this plan gave them.
    tier_saves: list[tuple[int, bytes, str]] = field(default_factory=list)
    tier_loads: list[tuple[int, bytes, str]] = field(default_factory=list)
    # LoRA adapters written into device slots before this step's forward (``engine.core.lora_residency``), and
    # the (key, directory) of adapters rank 0 began reading since the last step (the other ranks read them too).
    lora_loads: list[LoraLoad] = field(default_factory=list)
    lora_reads: list[tuple[str, str]] = field(default_factory=list)
    # Hybrid models' state checkpoints (``engine.core.state_checkpoints``), as (from row, to row) of the state
    # cache: loads (checkpoint -> an admitted hit's slot) before the forward, saves (slot -> checkpoint) after it.
    state_loads: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    # Layer-chunked encoding: the tower blocks rank 0 runs for images before this step's forward (a plan may hold
    # only these: the image's request then computes no token this step).
    encoder_pieces: list[EncoderPiece] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class RequestUpdate:
    """What one step did to one request, for the output processor."""

    request: Request
    new_token_ids: list[int]
    finished: bool


def _running_order(request: Request) -> tuple[int, int]:
    return (request.priority, request.admit_seq)


class Scheduler:
    """Owns the waiting queue, the running list (sorted by priority, then admission) and the KV cache manager."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, clock=time.monotonic,
                 speculator: Speculator | None = None, tiers: PrefixTiers | None = None,
                 lora: LoraResidency | None = None,
                 image_cached: Callable[[bytes, str | None], bool] | None = None,
                 image_ready: Callable[[PromptImage], bool] | None = None) -> None:
        """``speculator``: speculative decoding's proposer (None: off). ``tiers``: the prefix-cache tiers below
        the device pool (None: none). ``lora``: which adapters are resident in the device slots (None: the engine
        serves no adapters). ``image_cached(digest, cache_salt)``: whether the encoder cache holds an image now
        (None: no cache), so that it costs no encoder budget. ``image_ready(image)``: whether the tower could read
        an image's pixels now (False: they are being preprocessed off the step loop; None: always)."""
        self.config = scheduler_config
        self.image_cached = image_cached
        self.image_ready = image_ready
        # Whether this step's plan left an image waiting for its pixels (the engine may wait a moment for them).
        self.images_preparing = False
        self._encoder_used = 0  # image tokens this step's plan hands to the vision tower so far
        c = scheduler_config
        # Layer-chunked encoding (None: whole images); the pieces the last ``_encoder_cap`` planned, not yet run.
        self.encoder_steps = (EncoderSteps(c.max_num_encoder_token_blocks, c.encoder_stages, c.encoder_patches_per_token,
                                           share=c.encoder_cache_keeps,
                                           attention_per_patch=c.encoder_attention_per_patch)
                              if c.max_num_encoder_token_blocks is not None else None)
        self._pending_pieces: list[EncoderPiece] = []
        self.speculator = speculator
        self.kv = KVCacheManager(cache_config.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
                                 cache_config.sliding_window, tiers, cache_config.eviction_policy)
        # Hybrid models' recurrent states: a slot per running request (None: the model keeps none).
        self.states = StateSlots(cache_config.num_state_slots) if cache_config.num_state_slots else None
        # Their prefix-cache hits resume from state checkpoints (None: no checkpoints, or no prefix cache).
        self.checkpoints: StateCheckpoints | None = None
        if cache_config.num_state_checkpoints and cache_config.enable_prefix_caching:
            self.checkpoints = StateCheckpoints(cache_config.num_state_checkpoints, cache_config.num_state_slots,
                                                cache_config.block_size, cache_config.state_checkpoint_interval)
        self.vtc = VirtualTokenCounter()
        self.waiting = WaitingQueue(self.vtc)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.clock = clock
        self._admit_seq = itertools.count()
        self._finished_since_last_step: list[str] = []
        self.num_preemptions = 0
        self.num_promotions = 0  # requests promoted for having gone unserved for the starvation bound
        self._now = clock()  # the step's clock reading (``_schedule``)
        self._last_prefill_tokens = 0
        self._last_decode_tokens = 0
        self.total_prefill_tokens = 0
        self.total_decode_tokens = 0
        self.spec_draft_tokens = 0  # cumulative: drafts scheduled for verification
        self.spec_accepted_tokens = 0  # cumulative: drafts the model agreed with
        self.spec_steps = 0  # cumulative: request-steps that verified drafts (each emits 1 + its accepted)
        self._num_foreground = 0  # requests waiting or running that are not background
        self._foreground_seen = -float("inf")  # clock() when foreground work was last present
        self._background_left: float = float("inf")  # background tokens this step may still take
        # LoRA adapters beyond the device slots (None: the engine serves none): requests whose adapter is not
        # resident wait here, by adapter in the order first asked for, not in the waiting queue.
        self.lora = lora
        self._lora_waiting: dict[str, list[Request]] = {}
        self._lora_reads: list[tuple[str, str]] = []  # reads begun since the last plan (SchedulerOutput.lora_reads)
        self.last_step_ms = 0.0  # host time of the last step's schedule() plus update(), milliseconds

    # ---- queue management -------------------------------------------------
    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        assert request.num_tokens < self.config.max_model_len, "the engine rejects prompts that leave no room to generate"
        self.requests[request.request_id] = request
        request.idle_since = self.clock()  # the starvation bound counts on the scheduler's clock
        self._num_foreground += not request.policy.background
        self.vtc.on_arrival(request.policy.tenant)
        if request.policy.lora_adapter is not None and self.lora is not None:
            self.lora.request_added(request.policy.lora_adapter)
        self.waiting.add(request)

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
        if request.all_token_ids[-1] == PLACEHOLDER:  # aborted while its step ran: that token is never known
            request.all_token_ids.pop()
            request.output_token_ids.pop()
        adapter = request.policy.lora_adapter
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif adapter is not None and request in self._lora_waiting.get(adapter, ()):
            self._lora_waiting[adapter].remove(request)
            if not self._lora_waiting[adapter]:
                del self._lora_waiting[adapter]
        else:
            self.waiting.remove(request)
        if adapter is not None and self.lora is not None:
            self.lora.request_ended(adapter)
        request.status = status
        self.kv.free(request)
        if self.encoder_steps is not None:
            self.encoder_steps.release(request.request_id)
        if self.states is not None:
            self.states.free(request.request_id)
        if self.checkpoints is not None:
            self.checkpoints.drop(request.request_id)
        del self.requests[request.request_id]
        self._num_foreground -= not request.policy.background
        self.vtc.on_departure(request.policy.tenant)
        self._finished_since_last_step.append(request.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def foreground_recent(self) -> bool:
        """Whether foreground work is present, or was at a step within ``background_window_s``.

        While it is, background work is capped (see the module docstring); the engine process also
        sizes its CPU threads by it (``engine.serving.serving_threads``).
        """
        return self._num_foreground > 0 or self.clock() - self._foreground_seen <= self.config.background_window_s

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_lora_waiting(self) -> int:
        """Requests set aside until their LoRA adapter is written into a device slot."""
        return sum(len(q) for q in self._lora_waiting.values())

    # ---- preemption -------------------------------------------------------
    def _preempt(self, victim: Request, preempted: list[str]) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        if self.encoder_steps is not None:  # its progress stays; another request may begin the image meanwhile
            self.encoder_steps.release(victim.request_id)
        if self.states is not None:  # its state is recomputed from its first token on resume, as its KV is
            self.states.free(victim.request_id)
        if self.checkpoints is not None:
            self.checkpoints.drop(victim.request_id)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.idle_since = self._now
        self.num_preemptions += 1
        self.waiting.add_preempted(victim)
        preempted.append(victim.request_id)

    def _memory_victim(self, served: set[str]) -> Request:
        for request in reversed(self.running):
            if request.request_id not in served:
                return request
        raise AssertionError("the request asking for memory is itself unserved")

    def _has_preemptible_below(self, priority: int) -> bool:
        return any(r.priority > priority and r.policy.preemptible for r in self.running)

    def _admission_victim(self, request: Request) -> Request | None:
        if not request.policy.may_preempt:  # its priority class waits for room like everyone else
            return None
        grace = request.policy.preempt_grace_ms
        if grace is not None and request.priority != PROMOTED and (self._now - request.idle_since) * 1e3 < grace:
            return None  # room usually frees within its grace; the running request keeps its progress
        # Less urgent than the request's own class (a promoted request preempts no more than its class could);
        # a promoted running request is less urgent than none.
        candidates = [
            r for r in self.running
            if r.priority > request.policy.priority and r.policy.preemptible and r.request_id not in self._served
        ]
        return max(candidates, key=_running_order) if candidates else None

    # ---- one step ---------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The next step's plan: which requests run and how many of their tokens."""
        start = time.perf_counter()
        plan = self._schedule()
        self.last_step_ms = (time.perf_counter() - start) * 1e3
        return plan

    def _promote_starving(self) -> None:
        """Promote every request unserved for the starvation bound (see the module docstring)."""
        bound = self.config.starvation_bound_s
        starving = [r for r in (*self.waiting, *self.running)
                    if r.priority != PROMOTED and self._now - r.idle_since > bound]
        for request in starving:
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
                request.priority = PROMOTED
                bisect.insort(self.running, request, key=_running_order)
            else:
                self.waiting.remove(request)
                request.priority = PROMOTED
                self.waiting.add_preempted(request)  # in arrival order among the promoted
        self.num_promotions += len(starving)

    def _schedule(self) -> SchedulerOutput:
        self._now = self.clock()
        if self.config.starvation_bound_s is not None:
            self._promote_starving()
        self._budget = self.config.max_num_batched_tokens
        self._encoder_used = 0
        self.images_preparing = False
        if self.encoder_steps is not None:
            self.encoder_steps.begin_step()
        self._scheduled: list[ScheduledRequest] = []
        self._served: set[str] = set()
        preempted: list[str] = []
        self._background_left = self._background_allowance()
        lora_loads = self._plan_lora_loads() if self.lora is not None else []

        priorities = sorted({r.priority for r in self.running} | set(self.waiting.priorities()))
        memory_pressure = False
        for priority in priorities:
            memory_pressure |= self._schedule_running(priority, preempted)
            # After a memory preemption, admit only where less urgent work can make room: admitting
            # equal-priority work into blocks just taken from a running request would thrash.
            if not memory_pressure or self._has_preemptible_below(priority):
                self._admit(priority, preempted)

        finished = self._finished_since_last_step
        self._finished_since_last_step = []
        scheduled = self._scheduled
        saves, loads = self.kv.take_transfers()
        state_loads, state_saves = self.checkpoints.take_copies() if self.checkpoints is not None else ([], [])
        self._last_decode_tokens = sum(s.num_new_tokens for s in scheduled
                                       if s.sample and s.num_new_tokens - len(s.draft_token_ids) == 1)
        self._last_prefill_tokens = self.config.max_num_batched_tokens - self._budget - self._last_decode_tokens
        self.total_prefill_tokens += self._last_prefill_tokens
        self.total_decode_tokens += self._last_decode_tokens
        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.config.max_num_batched_tokens - self._budget,
            preempted_ids=preempted,
            finished_ids=finished,
            tier_saves=saves,
            tier_loads=loads,
            lora_loads=lora_loads,
            lora_reads=self._take_lora_reads(),
            state_loads=state_loads,
            state_saves=state_saves,
            encoder_pieces=self.encoder_steps.pieces if self.encoder_steps is not None else [],
        )

    def _take_lora_reads(self) -> list[tuple[str, str]]:
        reads, self._lora_reads = self._lora_reads, []
        return reads

    def _plan_lora_loads(self) -> list[LoraLoad]:
        """Adapters that waiting requests need, written into slots before this step (those whose factors are in
        host memory, into free slots or ones no running request pins); their requests rejoin the queue."""
        if not self._lora_waiting:
            return []
        in_use = {r.policy.lora_adapter for r in self.running if r.policy.lora_adapter is not None}
        loads = self.lora.plan_loads(list(self._lora_waiting), in_use)
        for load in loads:
            for request in self._lora_waiting.pop(load.name):
                if request.status == RequestStatus.PREEMPTED:
                    self.waiting.add_preempted(request)
                else:
                    self.waiting.add(request)
        return loads

    def fail_lora_waiting(self, adapter: str, reason: str) -> list[Request]:
        """End the requests set aside for ``adapter`` (a registration key) with finish_reason 'error' and ``reason``
        as their stop_reason: its factors could not be read. Returns them; every other request goes on."""
        ended = list(self._lora_waiting.get(adapter, ()))
        for request in ended:
            self._finish(request, RequestStatus.FINISHED_ERROR)
            request.stop_reason = reason
        return ended

    def _wait_for_adapter(self, request: Request) -> bool:
        """True (and the request set aside until its adapter is written into a slot) if its adapter is not
        resident: it neither runs nor holds back the requests behind it."""
        name = request.policy.lora_adapter
        if name is None or self.lora is None or self.lora.slot(name) is not None:
            return False
        self.waiting.remove(request)
        self._lora_waiting.setdefault(name, []).append(request)
        self._lora_reads.append(self.lora.prefetch(name))
        return True

    def _background_allowance(self) -> float:
        """Tokens background requests may take this step (see the module docstring)."""
        now = self.clock()
        if self._num_foreground:
            self._foreground_seen = now
        if now - self._foreground_seen > self.config.background_window_s:
            return float("inf")
        foreground_prefill = self.waiting.num_foreground > 0 or any(
            not r.policy.background and r.num_tokens - r.num_computed_tokens > 1 for r in self.running)
        return 0 if foreground_prefill else self.config.background_token_budget

    def _schedule_running(self, priority: int, preempted: list[str]) -> bool:
        """Serve this priority's running requests; True if memory ran out and forced a preemption."""
        pressure = False
        for request in [r for r in self.running if r.priority == priority]:
            if self._budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if self._ends_in_flight(request):
                continue
            num_new = self._chunk(request.num_tokens - request.num_computed_tokens)
            if self._capped(request):
                num_new = min(num_new, self._background_left)
                if num_new <= 0:
                    continue  # it keeps its blocks and waits for a step with room
            if self.checkpoints is not None:
                num_new = self.checkpoints.cap(request, request.num_computed_tokens, num_new)
            num_new = self._encoder_cap(request, request.num_computed_tokens, num_new)
            if num_new <= 0:
                self._commit_pieces(request)  # its image's next blocks run, if any fit this step
                continue  # its next image waits for a step with encoder budget left; it keeps its blocks
            assert num_new > 0, "a running request always has a token to compute"
            if num_new == 1 and self.speculator is not None and self._schedule_drafts(request):
                continue
            while not self.kv.allocate_slots(request, num_new):
                pressure = True
                victim = self._memory_victim(self._served)
                self._preempt(victim, preempted)
                if victim is request:
                    break
            else:
                self._add_scheduled(request, num_new)
        return pressure

    @staticmethod
    def _capped(request: Request) -> bool:
        """Background work within the step's background allowance (a promoted request is not capped)."""
        return request.policy.background and request.priority != PROMOTED

    def _ends_in_flight(self, request: Request) -> bool:
        """Its last token is still on the device (overlapped steps) and is its last by length: scheduling it
        again would compute a token past ``max_tokens``."""
        return request.all_token_ids[-1] == PLACEHOLDER and (
            request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len)

    def _schedule_drafts(self, request: Request) -> bool:
        """Schedule a decoding request with its drafts, if it has any and they fit without preempting anyone."""
        room = self._budget if not self._capped(request) else min(self._budget, self._background_left)
        drafts = self.speculator.propose(request, len(self.running))[:max(int(room) - 1, 0)]
        if not drafts or not self.kv.allocate_slots(request, 1 + len(drafts)):
            return False
        self._add_scheduled(request, 1 + len(drafts), drafts)
        return True

    def _admit(self, priority: int, preempted: list[str]) -> None:
        """Admit waiting requests of ``priority`` (fairly across tenants) while budget, slots and blocks allow."""
        passed: set[str] = set()  # requests of this class waiting for their blocks from disk this step
        while self._budget > 0:
            request = self.waiting.peek(priority, passed)
            if request is None or (self._capped(request) and self._background_left <= 0):
                return
            if self._wait_for_adapter(request):
                continue
            if len(self.running) >= self.config.max_num_seqs or (self.states is not None and not self.states.num_free):
                victim = self._admission_victim(request)
                if victim is None:
                    return
                self._preempt(victim, preempted)
                continue
            # Prompt logprobs need every prompt position computed: no prefix-cache hits for them.
            cached = CachedPrefix()
            if request.sampling_params.prompt_logprobs is None:
                cached = self.kv.find_tier_prefix(request, self.kv.find_cached_prefix(request))
                if cached is None:
                    # Its next blocks are being read from disk: it waits (for a step or a few) in its place, and
                    # the requests behind it are admitted meanwhile; running requests keep stepping.
                    passed.add(request.request_id)
                    continue
                if self.checkpoints is not None:
                    cached = self._resumable(request, cached)
                    if cached is None:
                        # Its hit's last block is being checkpointed by a running request: it waits in its place
                        # for that (a step or two) rather than compute the shared prefix again.
                        passed.add(request.request_id)
                        continue
            num_cached = cached.num_blocks * self.kv.block_size
            num_new = self._chunk(request.num_tokens - num_cached)
            if self._capped(request):
                num_new = min(num_new, self._background_left)
            if self.checkpoints is not None and num_new > 0:
                num_new = self.checkpoints.cap(request, num_cached, num_new)
            if num_new > 0 and request.images:
                num_new = self._encoder_cap(request, num_cached, num_new)
                if num_new <= 0:  # its first image waits for a step with encoder budget; those behind it may run
                    self._commit_pieces(request)  # its image's next blocks run (waiting: it needs no KV for that)
                    self.kv.release_tier_hits(cached)
                    passed.add(request.request_id)
                    continue
            if not self.kv.allocate_slots(request, num_new, cached):
                self.kv.release_tier_hits(cached)
                victim = self._admission_victim(request)
                if victim is None:
                    return
                self._preempt(victim, preempted)
                continue
            self.waiting.remove(request)
            self.kv.record_prefix_hit(request, num_cached)
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            if request.first_scheduled_time is None:
                request.first_scheduled_time = self.clock()
            request.status = RequestStatus.RUNNING
            request.admit_seq = next(self._admit_seq)
            if self.states is not None:
                slot = self.states.allocate(request.request_id)
                if cached.num_blocks and self.checkpoints is not None:  # its state resumes after the hit
                    self.checkpoints.plan_load(cached.groups[0][-1].block_hash, slot)
            bisect.insort(self.running, request, key=_running_order)
            self._add_scheduled(request, num_new)

    def _resumable(self, request: Request, cached: CachedPrefix) -> CachedPrefix | None:
        """A hybrid model's hit, cut back to its last block whose state the linear layers can resume from (where
        the KV hit ran further, ``request`` checkpoints its state there: ``StateCheckpoints.note_hit``). None: a
        running request's checkpoint at the hit's end is being taken, so ``request`` waits for it."""
        blocks = cached.groups[0] if cached.groups else []
        assert all(isinstance(b, Block) for b in blocks) and len(cached.groups) <= 1, \
            "no checkpoints with the tiers or a sliding group"
        n = self.checkpoints.resumable(blocks)
        if n < len(blocks) and self.checkpoints.being_saved(blocks[-1].block_hash):
            return None
        self.checkpoints.note_hit(request, len(blocks), n)
        return CachedPrefix(n, [blocks[:n]]) if n else CachedPrefix()

    def _plan_checkpoint(self, request: Request, num_new: int, slot: int) -> None:
        """A checkpoint of the state after this chunk, where it ends at a checkpoint boundary."""
        end = request.num_computed_tokens + num_new
        if end % self.kv.block_size or not self.checkpoints.is_boundary(request, end // self.kv.block_size):
            return
        k = end // self.kv.block_size
        # The last token may still be on the device (overlapped steps): then its key is known only at commit.
        key = self.kv.prefix_key(request, k) if request.all_token_ids[end - 1] != PLACEHOLDER else None
        self.checkpoints.plan_save(request.request_id, k, key, slot, lambda h: self.kv.pool.lookup(h) is not None)

    def _chunk(self, num_left: int) -> int:
        """Tokens of a request with ``num_left`` to compute that this step takes: what the budget allows, and a
        prompt's chunk at most ``prefill_chunk_tokens`` (a decode token, or a decode token with drafts, is not
        capped)."""
        cap = self.config.prefill_chunk_tokens
        return min(num_left, self._budget, cap if cap and num_left > 1 else num_left)

    def _images_to_encode(self, request: Request, start: int, end: int) -> list[tuple[int, int]]:
        """(index, image tokens the tower encodes) of each image the chunk [start, end) is the first to touch for
        the request, in order: 0 tokens for one the encoder cache holds. Images wholly before ``start`` (a
        prefix-cache hit) are never encoded."""
        out = []
        for i, image in enumerate(request.images):
            if image.offset >= end:
                break
            if image.end <= start or i in request.encoded_images:
                continue
            cached = self.image_cached is not None and self.image_cached(image.digest, request.policy.cache_salt)
            out.append((i, 0 if cached else image.num_tokens))
        return out

    def _encoder_cap(self, request: Request, start: int, num_new: int) -> int:
        """``num_new`` cut before the first image the chunk would encode past the step's encoder budget (0: not
        even its first token fits); the step's first image is encoded whatever its size. Layer-chunked: cut
        before the first image whose last block does not run this step, the pieces to run kept for
        ``_commit_pieces``."""
        budget = self.config.max_num_encoder_tokens
        self._pending_pieces = []
        if len(request.encoded_images) == len(request.images):
            return num_new
        num_new = self._pixels_cap(request, start, num_new)
        if self.encoder_steps is not None:
            to_encode = self._images_to_encode(request, start, start + num_new)
            num_new, self._pending_pieces = self.encoder_steps.plan(request, start, num_new, to_encode)
            return num_new
        if budget is None:
            return num_new
        used = self._encoder_used
        for i, tokens in self._images_to_encode(request, start, start + num_new):
            if tokens and used and used + tokens > budget:
                return max(request.images[i].offset - start, 0)
            used += tokens
        return num_new

    def _pixels_cap(self, request: Request, start: int, num_new: int) -> int:
        """``num_new`` cut before the first image the chunk would hand the tower whose pixels are not ready
        (``image_ready``: being preprocessed off the step loop); it waits for a later step, before its tower runs."""
        if self.image_ready is not None:
            for i, tokens in self._images_to_encode(request, start, start + num_new):
                if tokens and not self.image_ready(request.images[i]):
                    self.images_preparing = True
                    return max(request.images[i].offset - start, 0)
        return num_new

    def _commit_pieces(self, request: Request) -> None:
        """Run the pieces ``_encoder_cap`` last planned for ``request`` this step (none if it planned for another:
        a chunk that was then not scheduled)."""
        if self._pending_pieces and self._pending_pieces[0].request is request:
            self.encoder_steps.commit(self._pending_pieces)
            request.idle_since = self._now  # its image advances: not unserved (the starvation bound)
        self._pending_pieces = []

    def _add_scheduled(self, request: Request, num_new: int, drafts: list[int] | None = None) -> None:
        sample = request.num_computed_tokens + num_new - len(drafts or ()) == request.num_tokens
        rid = request.request_id
        slot = self.states.slot(rid) if self.states is not None else -1
        self._scheduled.append(ScheduledRequest.of(request, num_new, self.kv.block_ids(rid), sample, drafts,
                                                   self.kv.window_block_ids(rid), slot))
        if self.checkpoints is not None and not drafts:
            self._plan_checkpoint(request, num_new, slot)
        self._served.add(request.request_id)
        request.idle_since = self._now
        self._budget -= num_new
        self._commit_pieces(request)
        if len(request.encoded_images) < len(request.images):
            start = request.num_computed_tokens
            for i, tokens in self._images_to_encode(request, start, start + num_new):
                request.encoded_images.add(i)
                self._encoder_used += tokens
        if self._capped(request):
            self._background_left -= num_new

    def update(self, plan: SchedulerOutput, sampled_token_ids: list[int | list[int] | None]) -> list[RequestUpdate]:
        """Apply a step's sampled tokens to its requests; returns what changed for each."""
        start = time.perf_counter()
        updates = self._update(plan, sampled_token_ids)
        self.last_step_ms += (time.perf_counter() - start) * 1e3
        return updates

    def _update(self, plan: SchedulerOutput, sampled_token_ids: list[int | list[int] | None]) -> list[RequestUpdate]:
        """Advance computed counts, append sampled tokens, bill fair-share counters, finish what is done.

        ``sampled_token_ids`` is aligned with ``plan.scheduled``; None where
        the chunk did not reach the end of the request (nothing sampled); for a part with drafts, the token
        sampled at each of its 1 + K rows.
        """
        assert len(sampled_token_ids) == len(plan.scheduled)
        updates: list[RequestUpdate] = []
        for item, token in zip(plan.scheduled, sampled_token_ids):
            request = item.request
            if request.status != RequestStatus.RUNNING:
                continue  # aborted between schedule() and update()
            drafts = item.draft_token_ids
            if drafts:
                tokens = accepted_prefix(drafts, token)
                self._count_speculation(request, len(drafts), len(tokens) - 1)
                computed = request.num_computed_tokens + len(tokens)
            else:
                request.num_computed_tokens += item.num_new_tokens
                tokens = [token] if item.sample else []
            status, appended = None, []
            if item.sample:
                assert tokens and tokens[0] is not None
                status, appended = self._append_tokens(request, tokens)
            if drafts:
                # KV is kept for the last known token and the accepted drafts (up to a stop, if one came first);
                # the rejected rows' KV is dropped. Blocks are hashed only once their tokens are appended.
                request.num_computed_tokens = min(computed, request.num_tokens - 1)
            self._account_computed(request, len(appended))
            if not item.sample:
                continue
            if status is not None:
                self._finish(request, status)
            elif drafts:
                self.kv.trim(request, request.num_tokens)  # blocks that only rejected drafts used go back
            updates.append(RequestUpdate(request, appended, status is not None))
        return updates

    def _append_tokens(self, request: Request, tokens: list[int]) -> tuple[RequestStatus | None, list[int]]:
        """Append tokens one by one, stopping where decoding one token a step would have (EOS, stop ids, length)."""
        for i, token in enumerate(tokens):
            request.append_output_token(token)
            status = self._stop_status(request, token)
            if status is not None:
                return status, tokens[:i + 1]
        return None, tokens

    def _count_speculation(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        self.spec_draft_tokens += num_drafts
        self.spec_accepted_tokens += num_accepted
        self.spec_steps += 1
        self.speculator.record(request, num_drafts, num_accepted)

    def _account_computed(self, request: Request, num_output: int) -> None:
        """Register the blocks the step filled in the prefix cache and bill the tenant's fair-share counter."""
        if request.status == RequestStatus.RUNNING:  # a request preempted since has no blocks to register
            self.kv.cache_computed_blocks(request)
            if self.checkpoints is not None:
                self.checkpoints.commit(request, lambda k: self.kv.prefix_key(request, k))
        # Prompt tokens are billed once, even if preemption makes them computed again.
        prompt_done = min(request.num_computed_tokens, request.num_prompt_tokens)
        new_prompt = max(prompt_done - request.num_charged_prompt_tokens, 0)
        request.num_charged_prompt_tokens += new_prompt
        self.vtc.charge(request, new_prompt, num_output)

    def _check_stop(self, request: Request, token: int) -> RequestUpdate:
        status = self._stop_status(request, token)
        if status is not None:
            self._finish(request, status)
        return RequestUpdate(request, [token], status is not None)

    # ---- overlapped steps -------------------------------------------------
    def advance(self, plan: SchedulerOutput) -> None:
        """Account for a launched step whose tokens are not read yet (overlapped steps): its requests' computed
        counts move on, and each that samples gets a ``PLACEHOLDER`` token, so the next ``schedule()`` gives it
        its next position. Requests that ended since ``schedule()`` are left alone. ``resolve`` follows."""
        for item in plan.scheduled:
            request = item.request
            if request.status != RequestStatus.RUNNING:
                continue  # ended by the previous step's tokens: this step's token for it is dropped
            request.num_computed_tokens += item.num_new_tokens
            if item.sample:
                request.append_output_token(PLACEHOLDER)

    def resolve(self, plan: SchedulerOutput, sampled_token_ids: list[int | None]) -> list[RequestUpdate]:
        """``update()`` for a step that went through ``advance()``: fill each placeholder with its token, register
        the blocks computed, bill, run the stop checks (finishing what is done). Requests that ended meanwhile
        (aborted, stopped by the step before) are skipped: their token is never emitted nor counted."""
        start = time.perf_counter()
        assert len(sampled_token_ids) == len(plan.scheduled)
        updates: list[RequestUpdate] = []
        for item, token in zip(plan.scheduled, sampled_token_ids):
            request = item.request
            if request.is_finished:
                continue
            if item.sample:
                position = item.start + item.num_new_tokens  # where advance() put its placeholder
                assert request.all_token_ids[position] == PLACEHOLDER and token is not None
                request.all_token_ids[position] = token
                request.output_token_ids[position - request.num_prompt_tokens] = token
            self._account_computed(request, 1 if item.sample else 0)
            if item.sample:
                updates.append(self._check_stop(request, token))
        self.last_step_ms += (time.perf_counter() - start) * 1e3
        return updates

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.output_invalid:
            request.stop_reason = "the output broke its structured-output grammar"
            return RequestStatus.FINISHED_ERROR
        if request.num_output_tokens >= params.min_tokens:
            if token in params.stop_token_ids:
                request.stop_reason = token  # the caller's stop token; EOS leaves it None (as vLLM reports)
                return RequestStatus.FINISHED_STOPPED
            if token == request.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _waiting_by_priority(self) -> dict[int, int]:
        counts = self.waiting.count_by_priority()
        for queue in self._lora_waiting.values():
            for request in queue:
                counts[request.policy.priority] = counts.get(request.policy.priority, 0) + 1
        return dict(sorted(counts.items()))

    def stats(self) -> SchedulerStats:
        pool = self.kv.pool
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting_by_priority=self._waiting_by_priority(),
            kv_blocks_used=pool.num_blocks - pool.num_free_blocks,
            kv_blocks_total=pool.num_blocks,
            prefix_query_tokens=self.kv.prefix_query_tokens,
            prefix_hit_tokens=self.kv.prefix_hit_tokens,
            blocks_evicted=pool.num_evictions,
            num_preemptions=self.num_preemptions,
            step_prefill_tokens=self._last_prefill_tokens,
            step_decode_tokens=self._last_decode_tokens,
            total_prefill_tokens=self.total_prefill_tokens,
            total_decode_tokens=self.total_decode_tokens,
            spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
            spec_steps=self.spec_steps,
            num_promotions=self.num_promotions,
            kv_peak_request_blocks=list(self.kv.peak_request_blocks),
        )
