"""Building one rank of an engine whole, the same way on rank 0 (``LLMEngine``) and on every follower
(``engine.ranks.follower``): its model, KV pool and every part the settings ask for (EPLB, the draft model, LoRA
slot tables, the prefix-cache tiers or a follower's mirror of them, the grammar matchers, CUDA graphs), each built
first and handed to the runner's (and rank 0's scheduler's) constructor. Nothing is installed afterwards."""

from dataclasses import dataclass

import torch

from engine.core.config import CacheConfig, EngineConfig, KernelChoice, SchedulerConfig
from engine.core.lora_residency import LoraResidency
from engine.core.model_config import ModelConfig
from engine.core.scheduler import Scheduler
from engine.core.speculation import Speculator
from engine.distributed.collectives import TensorParallel
from engine.distributed.pipeline import WHOLE, PipelineStage
from engine.kv_tiers.setup import GB, build_rank_mirror, build_tiers
from engine.layers.moe import SparseMoeBlock
from engine.models import MoECausalLM
from engine.models.encoder_budget import attention_per_patch, auto_token_blocks
from engine.structured_output.matchers import GrammarMatchers
from engine.vision.encoder_cache import EncoderCache
from engine.worker.draft_model import DraftProposer
from engine.worker.lora_setup import serve_adapters
from engine.worker.model_setup import attention_backend, load_draft_model, load_rank_model, size_kv_pool
from engine.worker.cache_binding import attach_caches
from engine.worker.runner import ModelRunner, RunnerParts


@dataclass(frozen=True, slots=True)
class Leader:
    """What rank 0 of a replica has and its followers do not: the tokenizer (for the grammar matchers; None: the
    engine has none) and, with replicas sharing their experts, their rank-0 processes (expert balancing decides
    with them)."""

    tokenizer: object | None = None
    eos_token_id: int | None = None
    drivers: TensorParallel | None = None


@dataclass(slots=True)
class BuiltRank:
    """A rank as built: its model and runner, the KV pool every rank agreed on, the context it allows."""

    model: MoECausalLM
    runner: ModelRunner
    cache_config: CacheConfig
    max_model_len: int
    dense_gemv_choices: list


def build_rank(config: EngineConfig, model_config: ModelConfig, kernels: KernelChoice, dtype: torch.dtype,
               device: torch.device, tp: TensorParallel, stage: PipelineStage = WHOLE,
               leader: Leader | None = None) -> BuiltRank:
    """This rank's model (its stage's layers, its slices), KV pool and runner with all its parts; ``leader``:
    rank 0's inputs (None: a follower, which mirrors rank 0's host tier and samples nothing)."""
    max_len = min(config.max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings)
    torch.manual_seed(config.seed)
    model, dense_gemv_choices = load_rank_model(config, model_config, kernels, dtype, device, max_len, tp, stage)
    if model.takes_images:  # encoded images kept across requests, in host memory (engine.vision.encoder_cache);
        # rank 0's alone: it encodes, the other ranks receive each step's features (engine.models.image_step)
        size = int(config.encoder_cache_gb * GB) if leader is not None else 0
        model.encoder_cache = EncoderCache(size, config.encoder_cache_tenant_share)
    draft = load_draft_model(config, model_config, kernels, dtype, device, max_len) \
        if config.speculative == "draft" else None  # a single-process engine (EngineConfig checks)
    eplb = _balancer(config, model, tp, device, leader)  # before the KV pool is sized: spare slots take memory
    cache_config, max_len = size_kv_pool(config, model, device, dtype, draft, max_len)
    kv_caches = attach_caches(model, cache_config, device, dtype)
    attention = attention_backend(model, kernels.attention)
    graphs = _graphs(config, model, cache_config, kernels, attention, device, dtype, max_len, config.lora_enabled)
    lora = serve_adapters(config, model_config, model)  # after the MoE warm-up and any capture: none with it
    parts = RunnerParts(
        eplb=eplb, lora=lora,
        draft=DraftProposer(draft, cache_config, device, dtype, kernels.attention) if draft is not None else None,
        tiers=build_tiers(config, model, kv_caches, device, dtype) if leader is not None else None,
        tier_mirror=build_rank_mirror(config, kv_caches, device, tp.size) if leader is None else None,
        grammars=_grammars(leader, model_config.vocab_size, device),
        micro_batches=config.pipeline_micro_batches,
        overlapped_stage_zero=config.overlaps_pipeline_steps and model.stage.is_first, **graphs)
    runner = ModelRunner(model, cache_config, device, dtype, config.seed, kv_caches, attention, parts=parts)
    return BuiltRank(model, runner, cache_config, max_len, dense_gemv_choices)


def build_scheduler(config: EngineConfig, rank: BuiltRank) -> Scheduler:
    """Rank 0's scheduler over the rank's KV pool, with the speculator, tiers and adapter slots it serves."""
    lora = rank.runner.lora
    return Scheduler(
        SchedulerConfig(
            config.max_num_seqs, config.max_num_batched_tokens, rank.max_model_len,
            background_token_budget=config.background_token_budget,
            background_window_s=config.background_window_s,
            starvation_bound_s=config.starvation_bound_s,
            prefill_chunk_tokens=_prefill_chunk_cap(config),
            max_num_encoder_tokens=(config.max_num_encoder_tokens or config.max_num_batched_tokens)
            if rank.model.takes_images else None,
            max_num_encoder_token_blocks=encoder_token_blocks(config, rank.model),
            **(dict(zip(("encoder_stages", "encoder_patches_per_token"), rank.model.encoder_shape),
                    encoder_attention_per_patch=attention_per_patch(rank.model.tower_block),
                    encoder_cache_keeps=rank.model.encoder_cache.capacity_bytes > 0)
               if rank.model.takes_images else {}),
        ),
        rank.cache_config,
        speculator=Speculator(config.speculative_config, rank.max_model_len) if config.speculative else None,
        tiers=rank.runner.tiers,
        lora=LoraResidency(config.max_loras, lora.host) if lora is not None else None,
        image_cached=rank.model.image_cached if rank.model.takes_images else None,
        image_ready=rank.model.image_ready if rank.model.takes_images else None,
    )


def _prefill_chunk_cap(config: EngineConfig) -> int:
    """A request's prompt tokens a step, at most (0: as many as ``max_num_batched_tokens``). A decode engine's
    own prefills share steps with its streams: short chunks keep those steps short."""
    return config.decode_prefill_chunk_tokens if config.role == "decode" else 0


def encoder_token_blocks(config: EngineConfig, model: MoECausalLM) -> int | None:
    """The layer-chunked encoding budget of rank 0's steps, in token-blocks (None: whole images, bounded by
    ``max_num_encoder_tokens``): the operator's, else, unless they set ``max_num_encoder_tokens`` alone (whole
    images then), the default counted from the model (``engine.models.encoder_budget``) against the longest
    prompt chunk a step takes (a decode engine's are capped: ``_prefill_chunk_cap``); 0 turns it off."""
    asked = config.max_num_encoder_token_blocks
    if not model.takes_images or asked == 0 or (asked is None and config.max_num_encoder_tokens is not None):
        return None
    if asked is not None:
        return asked
    chunk = min(_prefill_chunk_cap(config) or config.max_num_batched_tokens, config.max_num_batched_tokens)
    return auto_token_blocks(model.model.layers, model.tower_block, chunk)


def check_kernels(kernels: KernelChoice) -> None:
    """ValueError where the kernels chosen cannot run here (Triton without CUDA or its interpreter)."""
    if kernels.uses_triton:
        import moe_kernels

        if "triton" not in moe_kernels.available_backends():
            raise ValueError("the triton kernels need CUDA (or TRITON_INTERPRET=1 for CPU testing)")


def _balancer(config: EngineConfig, model: MoECausalLM, tp: TensorParallel, device: torch.device,
              leader: Leader | None):
    """Expert load balancing over the experts' ranks (``enable_eplb``), else None; rank 0 decides together with
    the other replicas' rank 0 where replicas share their experts."""
    if not config.enable_eplb:
        return None
    from engine.eplb.balancer import ExpertBalancer

    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    return ExpertBalancer(blocks, tp.expert_parallel.tp, config.num_redundant_experts, config.eplb_window_steps,
                          config.eplb_interval_steps, device, leader.drivers if leader is not None else None)


def _grammars(leader: Leader | None, vocab_size: int, device: torch.device) -> GrammarMatchers | None:
    """Rank 0's structured-output matchers (it samples), where the engine has a tokenizer."""
    if leader is None or leader.tokenizer is None:
        return None
    return GrammarMatchers(leader.tokenizer, vocab_size, leader.eos_token_id, device)


def _graphs(config: EngineConfig, model: MoECausalLM, cache_config: CacheConfig, kernels: KernelChoice,
            attention: str, device: torch.device, dtype: torch.dtype, max_len: int, lora_served: bool) -> dict:
    """The decode and piecewise CUDA graphs that apply (as ``RunnerParts`` fields), captured over the bound caches,
    the MoE kernels compiled first."""
    # The linear-attention layers read host-built state metadata in Python loops: no graphs capture them yet.
    eager = config.enforce_eager or cache_config.num_state_slots > 0
    eager = eager or getattr(model, "eager_only", False)  # a family whose attention graphs do not capture yet
    # The torch MoE backend reads expert counts on the host, which a graph capture forbids.
    graph_safe_moe = kernels.moe != "torch"
    if device.type != "cuda" or not graph_safe_moe:
        return {}
    from engine.transforms.warmup import warm_up_moe

    warm_up_moe(model, config.max_num_batched_tokens, device, dtype)
    # Captured graphs would replay one rank's collectives alone: several ranks run eagerly. With adapters served
    # none are captured: without the per-step adapter layout they would replay the base model.
    if eager or lora_served or model.tp.size > 1 or model.tp.expert_parallel is not None or model.stage.pipelined:
        return {}
    graphs = {}
    if attention == "triton":
        from engine.transforms.cuda_graphs import build_decode_graphs

        graphs["decode_graphs"] = build_decode_graphs(model, cache_config, attention, device,
                                                      config.cuda_graph_batch_sizes, config.max_num_seqs, max_len)
    # Prefill and mixed steps: attention runs eagerly between the captured pieces, so either attention backend.
    from engine.transforms.piecewise_graphs import build_piecewise_graphs, default_token_sizes, layers_share_buffers

    if config.cuda_graph_token_sizes != () and layers_share_buffers(model):
        graphs["piecewise_graphs"] = build_piecewise_graphs(
            model, device, config.cuda_graph_token_sizes or default_token_sizes(config.max_num_batched_tokens))
    return graphs
