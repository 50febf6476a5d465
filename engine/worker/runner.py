"""The model runner: one forward over all scheduled tokens of a step, then sampling."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.device_batch.flat_batch import FlatBatch
from engine.worker.batch_builder import build_batch
from engine.core.config import CacheConfig
from engine.layers.moe import SparseMoeBlock
from engine.models import MoECausalLM
from engine.core.stats import EXPERT_LOAD_EVERY_CUDA
from engine.worker.state_cache import copy_states, step_states
from engine.eplb.expert_load import ExpertLoadReader
from engine.worker.pipeline_overlap import StageZeroSteps
from engine.worker.step_samples import StepSamples
from engine.worker.pipeline_step import run_stage
from engine.sampling.prompt_scoring import prompt_scoring
from engine.sampling.sampler import Sampler
from engine.structured_output.matchers import GrammarMatchers
from engine.core.lora_residency import LoraLoads, LoraReads
from engine.core.scheduler import ScheduledRequest, SchedulerOutput
from engine.core.tier_copies import TierCopies
from engine.eplb.balancer import Rebalance
from engine.worker.rank_messages import AskStageTimings, RankMessage, StepPlan, send_message

if TYPE_CHECKING:  # the modules that build these import this one
    from engine.eplb.balancer import ExpertBalancer
    from engine.transforms.cuda_graphs import DecodeGraphs
    from engine.transforms.piecewise_graphs import PiecewiseGraphs
    from engine.worker.draft_model import DraftProposer
    from engine.worker.lora_setup import LoraAdapters


@dataclass(frozen=True, slots=True)
class RunnerParts:
    """A runner's optional parts, each None (or off) unless the engine's settings ask for it; built before the
    runner, on rank 0 and on every follower alike (``engine.ranks.rank_builder``)."""

    eplb: ExpertBalancer | None = None  # enable_eplb
    lora: LoraAdapters | None = None  # where the engine serves adapters (graphs are then off)
    draft: DraftProposer | None = None  # speculative="draft"
    # The tiers' room ranks above the worker, so these two go untyped here.
    tiers: object | None = None  # rank 0's kv_tiers.store.TieredStore (host/disk prefix-cache tiers)
    tier_mirror: object | None = None  # a follower rank's slice of the host tier (kv_tiers.rank_mirror.RankMirror)
    grammars: GrammarMatchers | None = None  # rank 0's structured-output matchers (it has a tokenizer)
    decode_graphs: DecodeGraphs | None = None  # decode-only steps
    piecewise_graphs: PiecewiseGraphs | None = None  # prefill and mixed steps
    micro_batches: int = 1  # per pipelined step (EngineConfig.pipeline_micro_batches)
    overlapped_stage_zero: bool = False  # a stage-0 rank keeps two pipelined steps in flight


class ModelRunner:
    """Owns the model, the KV cache tensors and the sampler.

    Legend: T scheduled tokens, D decode requests, N requests that sample, H hidden.

    The caches hold one block more than the pool: the last one (``scratch_block``) belongs to no
    request and takes the K/V writes of padding rows (CUDA-graph batches padded to a captured size).
    ``attention_backend`` is "torch" or "triton" (``KernelChoice.attention``).
    """

    def __init__(self, model: MoECausalLM, cache_config: CacheConfig, device: torch.device, dtype: torch.dtype,
                 seed: int, kv_caches: list[tuple[torch.Tensor, ...]], attention_backend: str = "torch", *,
                 parts: RunnerParts = RunnerParts()) -> None:
        """``kv_caches``: the caches ``engine.worker.cache_binding.attach_caches`` bound into ``model`` (with a
        hybrid model's state rows); ``parts``: the optional parts the engine's
        settings ask for, each built before the runner (``engine.ranks.rank_builder``)."""
        assert attention_backend in ("torch", "triton"), attention_backend
        self.model = model
        self.device = device
        self.attention_backend = attention_backend
        self.block_size = cache_config.block_size
        self.scratch_block = cache_config.num_blocks
        self.decode_graphs = parts.decode_graphs
        self.piecewise_graphs = parts.piecewise_graphs
        self.eplb = parts.eplb
        self.lora = parts.lora
        self.draft = parts.draft
        self.tiers = parts.tiers
        self.tier_mirror = parts.tier_mirror
        self.tier_copy_ms = 0.0  # cumulative host time saving and loading tier blocks (on the CPU: the copies)
        self.last_prepare_ms = 0.0  # host time building the last step's batch (metadata and staging)
        self.last_execute_ms = 0.0  # host time of the last execute(), which waits for the sampled tokens
        self.num_steps = 0  # execute() calls that ran a forward
        self.group_steps = 0  # steps with a forward or a dummy step (with peer replicas): expert balancing's clock
        self.kv_caches = kv_caches
        # Hybrid models: the linear-attention layers' states, one per slot (``engine.core.state_slots``).
        self.state_slots = cache_config.num_state_slots
        # The sliding-window layers read their own block tables (a second KV cache group, ``cache_groups``).
        self.window_tables = cache_config.sliding_window is not None
        self.sliding_window = model.config.sliding_window
        self.sampler = Sampler(device, seed, parts.grammars)
        self.dtype = dtype
        self.moe_blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        self.expert_load = ExpertLoadReader([m.expert_tokens for m in self.moe_blocks], device, EXPERT_LOAD_EVERY_CUDA)
        self.stage = model.stage
        # Where the step's plan goes: this engine's tensor-parallel ranks, or every pipeline stage's.
        self.plans = self.stage.plans if self.stage.pipelined else model.tp
        self.micro_batches = parts.micro_batches
        # A follower stage-0 rank's overlapped pipelined steps (EngineConfig.overlaps_pipeline_steps).
        self.stage_zero = StageZeroSteps(self) if parts.overlapped_stage_zero else None

    def set_graphs(self, decode_graphs: DecodeGraphs | None = None, piecewise_graphs: PiecewiseGraphs | None = None) -> None:
        """Replace the CUDA-graph transforms the steps run through (None: eager). The engine's own graphs are given
        at construction (``RunnerParts``); this is for tests and benchmarks that run one engine's steps with and
        without them (``engine.transforms``)."""
        self.decode_graphs, self.piecewise_graphs = decode_graphs, piecewise_graphs

    # ---- batch construction -----------------------------------------------
    def prepare(self, scheduled: list[ScheduledRequest]) -> FlatBatch:
        """The step's flat batch (input_ids [T], positions [T], metadata, sampling rows) on the device."""
        batch = build_batch(scheduled, self.attention_backend, self.block_size, self.sliding_window,
                            self.model.num_local_kv_heads, self.device, self.model.config.layer_sliding_window)
        if self.state_slots:
            batch.meta.states = step_states(scheduled, batch.scheduled_ranges, self.device)
        if self.model.takes_images:  # the step's M-RoPE positions and image features (engine.models.qwen_image_text)
            batch.meta.images = self.model.image_step(scheduled, batch.scheduled_ranges, batch.input_ids.shape[0],
                                                      self.device)
        return batch

    def forward(self, batch: FlatBatch) -> torch.Tensor:
        """hidden [T, H] of the batch: a whole-forward CUDA graph for decode-only batches it covers, piecewise
        graphs (attention eager between them) for other batches they cover, else eager."""
        if self.model.takes_images:  # per-step image rows and 3-part positions: no graph captures them
            return self.model(batch.input_ids, batch.positions, batch.meta)
        if self.decode_graphs is not None and self.decode_graphs.covers(batch):
            return self.decode_graphs.run(batch)
        if self.piecewise_graphs is not None and self.piecewise_graphs.covers(batch):
            return self.piecewise_graphs.run(batch)
        return self.model(batch.input_ids, batch.positions, batch.meta)

    # ---- one step ------------------------------------------------------------
    def execute(self, plan: SchedulerOutput) -> StepSamples:
        """Run the step's forward; returns the sampled token per scheduled request (None if it did not sample)
        and the logprobs of the requests that asked."""
        start = time.perf_counter()
        sampled = self._execute(plan)
        self.last_execute_ms = (time.perf_counter() - start) * 1e3
        return sampled

    def encode_pieces(self, plan: SchedulerOutput) -> None:
        """Before the step's forward (rank 0, whose plans carry them): the vision tower work the plan runs for
        images encoded a few blocks (or rows of a block) a step (``engine.core.encoder_pieces``); the other ranks
        receive only finished features, with the steps that read them. First the features the step reads from
        the encoder cache are taken, which that work's own entries could evict."""
        if plan.encoder_pieces:
            self.model.take_cached(plan.scheduled, plan.encoder_pieces)
            self.model.encode_pieces(plan.encoder_pieces)

    def move_tier_blocks(self, plan: SchedulerOutput) -> None:
        """Before the step's forward: save the cached blocks the plan evicted from the pool to the host tier,
        then fill the blocks of the plan's host-tier hits (a block just saved may be a load's target)."""
        if self.tiers is not None and (plan.tier_saves or plan.tier_loads):
            start = time.perf_counter()
            copies = TierCopies(tuple(self.tiers.save(plan.tier_saves)),
                                tuple(self.tiers.load(plan.tier_loads)))
            if self.model.tp.size > 1:  # the other ranks copy their slices of the same blocks, ahead of the plan
                send_message(self.model.tp, copies)
            self.tier_copy_ms += (time.perf_counter() - start) * 1e3

    @torch.inference_mode()
    def _execute(self, plan: SchedulerOutput) -> StepSamples:
        self.sampler.forget(plan.finished_ids)
        if self.model.takes_images:
            self.model.forget_images(plan.finished_ids)
        self.move_tier_blocks(plan)
        self.encode_pieces(plan)
        if self.draft is not None:  # the drafts the scheduler left pending, proposed by the draft model
            self.draft.propose(plan)
        # Adapters the scheduler placed in slots, written on every rank before the forward; also with an empty
        # plan (the requests that waited for them may not fit this step), or a later plan would miss them.
        if plan.lora_reads and self.plans.size > 1:
            send_message(self.plans, LoraReads(tuple(plan.lora_reads)))
        if plan.lora_loads:
            if self.plans.size > 1:
                send_message(self.plans, LoraLoads(tuple(plan.lora_loads)))
            self.lora.apply(plan.lora_loads)
        if plan.is_empty:
            if self.steps_with_peers:
                self._rebalance_if_due()
                if self.model.tp.size > 1:  # this replica's other ranks step empty too
                    send_message(self.model.tp, StepPlan([]))
                self.dummy_step()
            return StepSamples([])
        self._rebalance_if_due()
        if self.plans.size > 1:  # the other ranks run the same forward on their slices (or stages) of the model
            send_message(self.plans, StepPlan.of(plan))
        self.num_steps += 1
        if self.stage.pipelined:  # the last stage's final hidden rows, sampled here
            hidden_rows = run_stage(self, plan.scheduled, self.stage, self.micro_batches).wait(self.stage)
            logits = self.model.compute_logits(hidden_rows) if hidden_rows.numel() else None  # [N + Q, V]
        else:
            start = time.perf_counter()
            batch = self.prepare(plan.scheduled)
            self.last_prepare_ms = (time.perf_counter() - start) * 1e3
            if self.lora is not None:
                self.lora.begin_step(plan.scheduled, batch.scheduled_ranges, batch.input_ids.shape[0], self.device)
            copy_states(self.model, plan.state_loads, self.device)  # hits resume from their checkpoints
            try:
                hidden = self.forward(batch)  # [T, H]
            finally:
                if self.lora is not None:
                    self.lora.end_step()
            copy_states(self.model, plan.state_saves, self.device)  # chunks that ended at a checkpoint
            logits = self._logits(hidden, batch)  # [N + Q, V]
        return self.sample(plan, logits)

    @torch.inference_mode()
    def sample(self, plan: SchedulerOutput, logits: torch.Tensor | None) -> StepSamples:
        """The step's tokens and logprobs from its logits [N + Q, V] (None: no row): the sampling rows (K + 1
        for a part with K drafts), then the prompt-scoring rows."""
        # One sampling row per sampling part, K + 1 for a part with K drafts (offsets 0..K).
        rows = [(s.request, j) for s in plan.scheduled if s.sample for j in range(len(s.draft_token_ids) + 1)]
        result = StepSamples([None] * len(plan.scheduled))
        scoring = prompt_scoring(plan.scheduled, self.device)
        if scoring is not None:  # computed before sampling adjusts logits in place, read after its sync
            prompt_lp = scoring.compute(logits[len(rows):])
        if rows:
            offsets = [j for _, j in rows] if len(rows) > sum(s.sample for s in plan.scheduled) else None
            # The step's one host sync: reading the tokens.
            out = self.sampler(logits[:len(rows)], [r for r, _ in rows], offsets)
            row = 0
            for i, s in enumerate(plan.scheduled):
                if not s.sample:
                    continue
                if s.draft_token_ids:
                    result.token_ids[i] = out.token_ids[row:row + len(s.draft_token_ids) + 1]
                    row += len(s.draft_token_ids) + 1
                    continue
                result.token_ids[i], lp = out.token_ids[row], out.logprobs[row]
                row += 1
                if lp is not None:
                    result.logprobs[s.request.request_id] = lp
        if scoring is not None:
            result.prompt_logprobs = scoring.read(prompt_lp)
        return result

    def _rebalance_if_due(self) -> None:
        """Expert load balancing between two steps, on every rank at once: rank 0's decision goes on the plans'
        channel, ahead of the plan. Counted in steps every replica of the experts' group takes together (a
        dummy step included), so replicas sharing their experts decide at the same step."""
        if self.eplb is None:
            return
        self.group_steps += 1
        if (rebalance := self.eplb.due(self.group_steps - 1)) is not None:
            if self.model.tp.size > 1:
                send_message(self.model.tp, rebalance)
            self.eplb.apply(rebalance)

    def _logits(self, hidden: torch.Tensor, batch: FlatBatch) -> torch.Tensor | None:
        """logits [N + Q, V]: the sampling rows', then the rows scoring prompt tokens (prompt logprobs); None if
        there are neither. Every rank computes the same rows (the LM head gathers across ranks)."""
        rows = batch.sample_rows
        if batch.prompt_rows.numel():
            rows = torch.cat([rows, batch.prompt_rows])
        return self.model.compute_logits(hidden.index_select(0, rows)) if rows.numel() else None

    @property
    def steps_with_peers(self) -> bool:
        """Data-parallel replicas sharing experts (the experts' group is larger than this replica's): every
        replica runs every step, with tokens or without."""
        ep = self.model.tp.expert_parallel
        return ep is not None and ep.tp.size > self.model.tp.size

    @torch.inference_mode()
    def dummy_step(self) -> None:
        """A step with no tokens of this engine's own: only the MoE layers run, to join the peers' collectives
        (attention and the rest involve no other engine)."""
        empty = torch.empty(0, self.model.config.hidden_size, dtype=self.dtype, device=self.device)  # [0, H]
        for block in self.moe_blocks:
            block(empty)

    # ---- a follower rank ------------------------------------------------------
    @torch.inference_mode()
    def follow(self, message: RankMessage) -> None:
        """A follower rank's part of what rank 0 sends on the plans' channel (``engine.worker.rank_messages``):
        the handler of its type in ``FOLLOW``. TypeError for anything else (``Stop`` ends the follower's loop
        before it comes here)."""
        handler = FOLLOW.get(type(message))
        if handler is None:
            raise TypeError(f"a follower rank has no handler for {type(message).__name__} on the plans' channel")
        handler(self, message)

    def _follow_step(self, message: StepPlan) -> None:
        """The same forward as rank 0's over this rank's slices of the model (its collectives pair with rank
        0's), including the logits' gather; rank 0 alone samples. No parts: a dummy step."""
        scheduled = message.scheduled()
        if self.stage.pipelined:  # no part: no micro-batch (it finishes an overlapped step in flight)
            self.num_steps += 1 if scheduled else 0
            if self.stage_zero is not None:  # overlapped steps: the LM head's gather one step behind
                self.stage_zero.step(scheduled, None)
            elif (rows := run_stage(self, scheduled, self.stage, self.micro_batches)) is not None:
                if (hidden_rows := rows.wait(self.stage)).numel():  # stage 0: the LM head's gather
                    self.model.compute_logits(hidden_rows)
            return
        if not scheduled:
            self.dummy_step()
            return
        self.num_steps += 1
        batch = self.prepare(scheduled)
        if self.lora is not None:  # each part names its adapter, as rank 0's requests do
            self.lora.begin_step(scheduled, batch.scheduled_ranges, batch.input_ids.shape[0], self.device)
        copy_states(self.model, message.state_loads, self.device)
        try:
            hidden = self.forward(batch)  # [T, H]
        finally:
            if self.lora is not None:
                self.lora.end_step()
        copy_states(self.model, message.state_saves, self.device)
        self._logits(hidden, batch)

    def _follow_rebalance(self, message: Rebalance) -> None:
        """Move expert weights between two steps, as rank 0 decided (``engine.eplb``)."""
        self.eplb.apply(message)

    def _follow_tier_copies(self, message: TierCopies) -> None:
        """Copy this rank's slices of host-tier blocks before the step (``engine.kv_tiers.rank_mirror``)."""
        self.tier_mirror.apply(message)

    def _follow_lora_loads(self, message: LoraLoads) -> None:
        """Write LoRA adapters into slots before the step (``engine.core.lora_residency``)."""
        self.lora.apply(message.loads)

    def _follow_lora_reads(self, message: LoraReads) -> None:
        """Start reading into host memory the adapters rank 0 began reading."""
        self.lora.prefetch(message.reads)

    def _answer_stage_timings(self, message: AskStageTimings) -> None:
        """How this rank's stage spent its time, in the all-gather rank 0 reads (``LLMEngine``)."""
        self.plans.all_gather_object(self.stage.timing)


# A follower rank's handler of each message on the plans' channel (``ModelRunner.follow``); ``Stop`` has none.
FOLLOW: dict[type, Callable[[ModelRunner, RankMessage], None]] = {
    StepPlan: ModelRunner._follow_step,
    Rebalance: ModelRunner._follow_rebalance,
    TierCopies: ModelRunner._follow_tier_copies,
    LoraLoads: ModelRunner._follow_lora_loads,
    LoraReads: ModelRunner._follow_lora_reads,
    AskStageTimings: ModelRunner._answer_stage_timings,
}
