"""The model runner: one forward over all scheduled tokens of a step, then sampling."""

import time
from collections.abc import Callable

import torch

from engine.device_batch.flat_batch import FlatBatch
from engine.worker.batch_builder import build_batch
from engine.core.config import CacheConfig
from engine.layers.moe import SparseMoeBlock
from engine.models import MoECausalLM
from engine.core.stats import EXPERT_LOAD_EVERY_CUDA
from engine.worker.cache_groups import cache_slots
from engine.worker.kv_memory import zeros_on_first_touch
from engine.worker.state_cache import attach_state_caches, step_states
from engine.eplb.expert_load import ExpertLoadReader
from engine.worker.pipeline_overlap import StageZeroSteps
from engine.worker.step_samples import StepSamples
from engine.worker.pipeline_step import run_stage
from engine.sampling.prompt_scoring import prompt_scoring
from engine.sampling.sampler import Sampler
from engine.core.lora_residency import LoraLoads, LoraReads
from engine.core.scheduler import ScheduledRequest, SchedulerOutput
from engine.core.tier_copies import TierCopies
from engine.eplb.balancer import Rebalance
from engine.worker.rank_messages import StepMessage, StepPlan


def attach_kv_caches(model: MoECausalLM, cache_config: CacheConfig, device: torch.device,
                     dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    """Zeroed caches per attention layer, each tensor [num_blocks + 1, block_size, *its per-token shape] as the
    layer's ``cache_spec()`` says ((K, V) for standard attention, one latent tensor for MLA), given to the layer
    as ``kv_cache``; the extra block is the scratch block padding rows write to. With two cache groups
    (``cache_config.sliding_window``) the i-th full and the i-th sliding layer share their tensors
    (``cache_groups``): the pool hands each block to one group of one request at a time."""

    def zeros(shape: tuple[int, ...], cache_dtype: torch.dtype) -> torch.Tensor:
        if device.type == "cpu":  # on the CPU, memory is taken as blocks are first written
            return zeros_on_first_touch(shape, cache_dtype)
        return torch.zeros(shape, dtype=cache_dtype, device=device)

    caches = []
    by_slot: dict[int, tuple[torch.Tensor, ...]] = {}
    for attn, slot in zip(model.attention_layers(), cache_slots(model, cache_config.sliding_window)):
        if slot not in by_slot:
            spec = attn.cache_spec()
            by_slot[slot] = tuple(zeros((cache_config.num_blocks + 1, cache_config.block_size, *shape),
                                        spec.dtype or dtype) for shape in spec.per_token)
        attn.kv_cache = by_slot[slot]
        caches.append(attn.kv_cache)
    return caches


class ModelRunner:
    """Owns the model, the KV cache tensors and the sampler.

    Legend: T scheduled tokens, D decode requests, N requests that sample, H hidden.

    The caches hold one block more than the pool: the last one (``scratch_block``) belongs to no
    request and takes the K/V writes of padding rows (CUDA-graph batches padded to a captured size).
    ``attention_backend`` is "torch" or "triton" (``KernelChoice.attention``).
    """

    def __init__(self, model: MoECausalLM, cache_config: CacheConfig, device: torch.device, dtype: torch.dtype, seed: int,
                 attention_backend: str = "torch") -> None:
        assert attention_backend in ("torch", "triton"), attention_backend
        self.model = model
        self.device = device
        self.attention_backend = attention_backend
        self.block_size = cache_config.block_size
        self.scratch_block = cache_config.num_blocks
        self.decode_graphs = None  # a cuda_graphs.DecodeGraphs, installed by cuda_graphs.enable_decode_graphs
        self.piecewise_graphs = None  # a piecewise_graphs.PiecewiseGraphs (prefill and mixed steps), likewise
        self.eplb = None  # an engine.eplb.balancer.ExpertBalancer (enable_eplb), installed by model_setup.build_rank
        self.lora = None  # a lora_setup.LoraAdapters where the engine serves adapters (graphs are then off)
        self.draft = None  # a draft_model.DraftProposer (speculative="draft"), installed by model_setup.build_rank
        self.tiers = None  # a kv_tiers.store.TieredStore (host/disk prefix-cache tiers), installed by the engine
        self.tier_mirror = None  # a follower rank's slice of the host tier (kv_tiers.rank_mirror), set at its start
        self.tier_copy_ms = 0.0  # cumulative host time saving and loading tier blocks (on the CPU: the copies)
        self.last_prepare_ms = 0.0  # host time building the last step's batch (metadata and staging)
        self.last_execute_ms = 0.0  # host time of the last execute(), which waits for the sampled tokens
        self.num_steps = 0  # execute() calls that ran a forward
        self.group_steps = 0  # steps with a forward or a dummy step (with peer replicas): expert balancing's clock
        self.kv_caches = attach_kv_caches(model, cache_config, device, dtype)
        # Hybrid models: the linear-attention layers' states, one per slot (``engine.core.state_slots``).
        self.state_slots = cache_config.num_state_slots
        if self.state_slots:
            attach_state_caches(model, self.state_slots, device, dtype)
        # The sliding-window layers read their own block tables (a second KV cache group, ``cache_groups``).
        self.window_tables = cache_config.sliding_window is not None
        self.sliding_window = model.config.sliding_window
        self.sampler = Sampler(device, seed)
        self.dtype = dtype
        self.moe_blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        self.expert_load = ExpertLoadReader([m.expert_tokens for m in self.moe_blocks], device, EXPERT_LOAD_EVERY_CUDA)
        self.stage = model.stage
        # Where the step's plan goes: this engine's tensor-parallel ranks, or every pipeline stage's.
        self.plans = self.stage.plans if self.stage.pipelined else model.tp
        self.micro_batches = 1  # per pipelined step (EngineConfig.pipeline_micro_batches; set by model_setup)
        # A follower stage-0 rank's overlapped pipelined steps (EngineConfig.overlaps_pipeline_steps; model_setup).
        self.stage_zero: StageZeroSteps | None = None

    # ---- batch construction -----------------------------------------------
    def prepare(self, scheduled: list[ScheduledRequest]) -> FlatBatch:
        """The step's flat batch (input_ids [T], positions [T], metadata, sampling rows) on the device."""
        batch = build_batch(scheduled, self.attention_backend, self.block_size, self.sliding_window,
                            self.model.num_local_kv_heads, self.device, self.model.config.layer_sliding_window)
        if self.state_slots:
            batch.meta.states = step_states(scheduled, batch.scheduled_ranges, self.device)
        if self.model.takes_images:  # the step's M-RoPE positions and image features (engine.models.qwen3_vl_moe)
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
    def execute(self, sched_out: SchedulerOutput) -> StepSamples:
        """Run the step's forward; returns the sampled token per scheduled request (None if it did not sample)
        and the logprobs of the requests that asked."""
        start = time.perf_counter()
        sampled = self._execute(sched_out)
        self.last_execute_ms = (time.perf_counter() - start) * 1e3
        return sampled

    def move_tier_blocks(self, sched_out: SchedulerOutput) -> None:
        """Before the step's forward: save the cached blocks the plan evicted from the pool to the host tier,
        then fill the blocks of the plan's host-tier hits (a block just saved may be a load's target)."""
        if self.tiers is not None and (sched_out.tier_saves or sched_out.tier_loads):
            start = time.perf_counter()
            copies = TierCopies(tuple(self.tiers.save(sched_out.tier_saves)),
                                tuple(self.tiers.load(sched_out.tier_loads)))
            if self.model.tp.size > 1:  # the other ranks copy their slices of the same blocks, ahead of the plan
                self.model.tp.broadcast_object(copies)
            self.tier_copy_ms += (time.perf_counter() - start) * 1e3

    @torch.inference_mode()
    def _execute(self, sched_out: SchedulerOutput) -> StepSamples:
        self.sampler.forget(sched_out.finished_ids)
        if self.model.takes_images:
            self.model.forget_images(sched_out.finished_ids)
        self.move_tier_blocks(sched_out)
        if self.draft is not None:  # the drafts the scheduler left pending, proposed by the draft model
            self.draft.propose(sched_out)
        # Adapters the scheduler placed in slots, written on every rank before the forward; also with an empty
        # plan (the requests that waited for them may not fit this step), or a later plan would miss them.
        if sched_out.lora_reads and self.plans.size > 1:
            self.plans.broadcast_object(LoraReads(tuple(sched_out.lora_reads)))
        if sched_out.lora_loads:
            if self.plans.size > 1:
                self.plans.broadcast_object(LoraLoads(tuple(sched_out.lora_loads)))
            self.lora.apply(sched_out.lora_loads)
        if sched_out.is_empty:
            if self.steps_with_peers:
                self._rebalance_if_due()
                if self.model.tp.size > 1:  # this replica's other ranks step empty too
                    self.model.tp.broadcast_object(StepPlan([]))
                self.dummy_step()
            return StepSamples([])
        self._rebalance_if_due()
        if self.plans.size > 1:  # the other ranks run the same forward on their slices (or stages) of the model
            self.plans.broadcast_object(follower_plan(sched_out))
        self.num_steps += 1
        if self.stage.pipelined:  # the last stage's final hidden rows, sampled here
            hidden_rows = run_stage(self, sched_out.scheduled, self.stage, self.micro_batches).wait(self.stage)
            logits = self.model.compute_logits(hidden_rows) if hidden_rows.numel() else None  # [N + Q, V]
        else:
            start = time.perf_counter()
            batch = self.prepare(sched_out.scheduled)
            self.last_prepare_ms = (time.perf_counter() - start) * 1e3
            if self.lora is not None:
                self.lora.begin_step(sched_out.scheduled, batch.scheduled_ranges, batch.input_ids.shape[0], self.device)
            try:
                hidden = self.forward(batch)  # [T, H]
            finally:
                if self.lora is not None:
                    self.lora.end_step()
            logits = self._logits(hidden, batch)  # [N + Q, V]
        return self.sample(sched_out, logits)

    @torch.inference_mode()
    def sample(self, sched_out: SchedulerOutput, logits: torch.Tensor | None) -> StepSamples:
        """The step's tokens and logprobs from its logits [N + Q, V] (None: no row): the sampling rows (K + 1
        for a part with K drafts), then the prompt-scoring rows."""
        # One sampling row per sampling part, K + 1 for a part with K drafts (offsets 0..K).
        rows = [(s.request, j) for s in sched_out.scheduled if s.sample for j in range(len(s.draft_token_ids) + 1)]
        result = StepSamples([None] * len(sched_out.scheduled))
        scoring = prompt_scoring(sched_out.scheduled, self.device)
        if scoring is not None:  # computed before sampling adjusts logits in place, read after its sync
            prompt_lp = scoring.compute(logits[len(rows):])
        if rows:
            offsets = [j for _, j in rows] if len(rows) > sum(s.sample for s in sched_out.scheduled) else None
            # The step's one host sync: reading the tokens.
            out = self.sampler(logits[:len(rows)], [r for r, _ in rows], offsets)
            row = 0
            for i, s in enumerate(sched_out.scheduled):
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
                self.model.tp.broadcast_object(rebalance)
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

    @torch.inference_mode()
    def follow(self, message: StepMessage) -> None:
        """A follower rank's part of what rank 0 sends on the plans' channel (``engine.worker.rank_messages``), by
        its type (``FOLLOW``): a ``StepPlan``'s forward; a ``Rebalance`` moves expert weights between two steps
        (``engine.eplb``); ``TierCopies`` copy this rank's slices of host-tier blocks before the step
        (``engine.kv_tiers.rank_mirror``); ``LoraLoads`` write LoRA adapters into slots before the step and
        ``LoraReads`` start reading them into host memory (``engine.core.lora_residency``)."""
        FOLLOW[type(message)](self, message)

    def _follow_plan(self, message: StepPlan) -> None:
        """The same forward as rank 0's over this rank's slices of the model (its collectives pair with rank
        0's), including the logits' gather; rank 0 alone samples. No parts: a dummy step."""
        plan = message.parts
        if self.stage.pipelined:  # an empty plan: no micro-batch (it finishes an overlapped step in flight)
            self.num_steps += 1 if plan else 0
            if self.stage_zero is not None:  # overlapped steps: the LM head's gather one step behind
                self.stage_zero.step(plan, None)
            elif (rows := run_stage(self, plan, self.stage, self.micro_batches)) is not None:
                if (hidden_rows := rows.wait(self.stage)).numel():  # stage 0: the LM head's gather
                    self.model.compute_logits(hidden_rows)
            return
        if not plan:
            self.dummy_step()
            return
        self.num_steps += 1
        batch = self.prepare(plan)
        if self.lora is not None:  # the plan names each part's adapter, as rank 0's requests do
            self.lora.begin_step(plan, batch.scheduled_ranges, batch.input_ids.shape[0], self.device)
        try:
            hidden = self.forward(batch)  # [T, H]
        finally:
            if self.lora is not None:
                self.lora.end_step()
        self._logits(hidden, batch)


# A follower rank's handler of each step message (``ModelRunner.follow``).
FOLLOW: dict[type, Callable[[ModelRunner, StepMessage], None]] = {
    StepPlan: ModelRunner._follow_plan,
    Rebalance: lambda runner, message: runner.eplb.apply(message),
    TierCopies: lambda runner, message: runner.tier_mirror.apply(message),
    LoraLoads: lambda runner, message: runner.lora.apply(message.loads),
    LoraReads: lambda runner, message: runner.lora.prefetch(message.reads),
}


def follower_plan(sched_out: SchedulerOutput) -> StepPlan:
    """The step as plain data for the other ranks: each scheduled part without the scheduler's Request."""
    return StepPlan([ScheduledRequest(None, s.num_new_tokens, s.block_ids, s.sample, s.start, s.token_ids,
                                      s.prompt_logprob_rows, s.draft_token_ids, s.window_block_ids,
                                      s.request.policy.lora_adapter, s.state_slot)
                     for s in sched_out.scheduled])
