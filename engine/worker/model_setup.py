"""Building a rank's model and runner from an ``EngineConfig``: the same on rank 0 and on follower ranks."""

import logging
from dataclasses import dataclass, replace

import torch

from engine.core.config import CacheConfig, EngineConfig, KernelChoice
from engine.core.kv_cache_manager import sliding_blocks_bound
from engine.distributed.collectives import SINGLE, TensorParallel
from engine.distributed.pipeline import WHOLE, PipelineStage
from engine.worker.pipeline_overlap import StageZeroSteps
from engine.core.model_config import CheckpointError, ModelConfig, load_model_config
from engine.loading.model_loader import build_model
from engine.layers.moe import SparseMoeBlock
from engine.loading.quantization import check_supported, resolve_scheme
from engine.models import MoECausalLM
from engine.worker.draft_model import DraftProposer
from engine.worker.cache_groups import kv_bytes_per_block, sliding_group_window
from engine.worker.runner import ModelRunner
from engine.worker.state_cache import linear_layers, state_bytes_per_slot

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    """The dtype a rank computes in: ``name`` (``EngineConfig.dtype``), or for "auto" the checkpoint's half
    precision on a GPU and float32 on the CPU."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # half precision matmuls are slow and inexact on most CPUs
    return _DTYPES.get(checkpoint_dtype, torch.bfloat16) if checkpoint_dtype != "float32" else torch.bfloat16


def engine_model_config(config: EngineConfig) -> ModelConfig:
    """The config of the model ``config`` serves: its random-weight spec's, or its checkpoint's (every rank
    reads it the same way, from the ``EngineConfig`` its engine process sent)."""
    if config.random_weights:
        from engine.loading.random_weights import random_model_config

        return random_model_config(config.random_weights)
    return load_model_config(config.model)


def load_rank_model(config: EngineConfig, model_config: ModelConfig, kernels: KernelChoice, dtype: torch.dtype,
                    device: torch.device, max_len: int, tp: TensorParallel,
                    stage: PipelineStage = WHOLE) -> tuple[MoECausalLM, list]:
    """This rank's model (its slices of every weight), with the build-time transforms the kernels ask for;
    returns it with the dense gemv choices made (empty unless measured)."""
    quantization = resolve_scheme(config.quantization, model_config, device, kernels.moe,
                                  tp.size if tp.expert_parallel is None else 1)
    check_supported(quantization, device, dtype, kernels.moe)
    if config.random_weights:  # this rank's slices of the unsplit random model of this seed
        from engine.loading.random_weights import build_random_model

        model = build_random_model(model_config, dtype, device, kernels.moe, max_len, config.seed, quantization, tp,
                                   stage)
    else:
        model = build_model(model_config, config.model, dtype, device, kernels.moe, max_len, tp, quantization, stage)
    if kernels.elementwise == "triton":
        from engine.transforms.fusion import enable_triton_elementwise

        enable_triton_elementwise(model)
    # Before the KV pool is sized: the measurement's scratch memory is given back by then.
    dense_gemv_choices = []
    if kernels.dense_gemv != "off":
        from engine.transforms.gemv_select import apply_dense_gemv

        dense_gemv_choices = apply_dense_gemv(model, device, kernels.dense_gemv)
    return model, dense_gemv_choices


def load_draft_model(config: EngineConfig, model_config: ModelConfig, kernels: KernelChoice, dtype: torch.dtype,
                     device: torch.device, max_len: int) -> MoECausalLM:
    """Speculative decoding's draft model (``speculative_model``), built as the target is; its vocabulary must be
    the target's (the drafts are the target's token ids)."""
    try:
        draft_config = load_model_config(config.speculative_model)
    except CheckpointError as e:  # the message names the directory; say which option gave it
        raise CheckpointError(f"speculative_model: {e}") from None
    if draft_config.vocab_size != model_config.vocab_size:
        raise ValueError(f"speculative_model {config.speculative_model!r} has a vocabulary of "
                         f"{draft_config.vocab_size} tokens, the model {model_config.vocab_size}: the draft model "
                         "must share the served model's tokenizer")
    model, _ = load_rank_model(replace(config, model=config.speculative_model, random_weights=None), draft_config,
                               kernels, dtype, device, max_len, SINGLE)
    logger.info("speculative draft model: %s (%s, %d layers)", config.speculative_model, draft_config.architecture,
                draft_config.num_layers)
    return model


def _memory_budget(config: EngineConfig, device: torch.device) -> float:
    """Bytes the KV pool (and a hybrid model's state slots) may take on this rank."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free - (1 - config.gpu_memory_utilization) * total
    return config.kv_cache_memory_gb * 2**30


def _agree(model: MoECausalLM, count: int) -> int:
    """The smallest ``count`` over every rank of the engine (each stage caches only its layers)."""
    agree = model.stage.plans if model.stage.pipelined else model.tp
    return agree.min_over_ranks(count)


def state_slots_for_memory(config: EngineConfig, model: MoECausalLM, device: torch.device, dtype: torch.dtype) -> int:
    """A hybrid model's state slots: one per request ``max_num_seqs`` lets run, within half the memory budget
    (the rest holds the full-attention layers' KV blocks); 0 for a model without linear-attention layers."""
    per_slot = state_bytes_per_slot(model, dtype)
    if not per_slot:
        return 0
    budget = _memory_budget(config, device)
    slots = min(config.max_num_seqs, int(budget / 2 // per_slot))
    if slots < 1:
        raise ValueError(f"the KV cache's memory ({budget / 2**20:.0f} MiB) cannot hold one request's recurrent "
                         f"state twice ({per_slot / 2**20:.1f} MiB): raise --kv-cache-memory-gb (CPU) or "
                         "--gpu-memory-utilization")
    return _agree(model, slots)


def kv_blocks_for_memory(config: EngineConfig, model: MoECausalLM, device: torch.device, dtype: torch.dtype,
                         draft: MoECausalLM | None = None, reserved: float = 0) -> int:
    """KV blocks this rank's memory budget holds (``num_kv_blocks`` if set); ranks agree on the smallest. A
    block's bytes include the draft model's K/V of its tokens, if there is one; ``reserved`` bytes of the budget
    are taken already (a hybrid model's state slots)."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    per_block = kv_bytes_per_block(model, config.block_size, dtype, sliding_group_window(model))
    if draft is not None:
        per_block += kv_bytes_per_block(draft, config.block_size, dtype)
    budget = _memory_budget(config, device) - reserved
    return _agree(model, max(int(budget // per_block), 1))


def attention_backend(model: MoECausalLM, wanted: str) -> str:
    """``wanted`` if every attention layer runs under it, else "torch" (said once in the log)."""
    missing = {type(attn).__name__ for attn in model.attention_layers() if wanted not in getattr(attn, "backends", (wanted,))}
    if missing:
        logger.info("attention: %s runs the torch path (no %s kernels for it yet)", ", ".join(sorted(missing)), wanted)
        return "torch"
    return wanted


def log_state_cache(model: MoECausalLM, slots: int, num_blocks: int, block_size: int, dtype: torch.dtype) -> None:
    """The pool's sizing at start: the state slots beside the KV blocks, and what each costs."""
    per_slot = state_bytes_per_slot(model, dtype)
    per_block = kv_bytes_per_block(model, block_size, dtype)
    logger.info("state cache: %d slots (one per running request) of %.2f MiB over %d linear-attention layers "
                "= %.1f MiB; KV cache: %d blocks of %d tokens, %.3f MiB each over %d full-attention layers = %.1f MiB",
                slots, per_slot / 2**20, len(linear_layers(model)), slots * per_slot / 2**20, num_blocks, block_size,
                per_block / 2**20, len(model.attention_layers()), num_blocks * per_block / 2**20)


def make_runner(config: EngineConfig, model: MoECausalLM, cache_config: CacheConfig, kernels: KernelChoice,
                device: torch.device, dtype: torch.dtype, max_len: int) -> ModelRunner:
    """The runner over ``model`` with its KV caches, MoE kernels compiled and, where they apply, decode and
    piecewise CUDA graphs."""
    attention = attention_backend(model, kernels.attention)
    runner = ModelRunner(model, cache_config, device, dtype, config.seed, attention)
    # The linear-attention layers read host-built state metadata in Python loops: no graphs capture them yet.
    eager = config.enforce_eager or cache_config.num_state_slots > 0
    eager = eager or getattr(model, "eager_only", False)  # a family whose attention graphs do not capture yet
    # The torch MoE backend reads expert counts on the host, which a graph capture forbids.
    graph_safe_moe = kernels.moe != "torch"
    if device.type == "cuda" and graph_safe_moe:
        from engine.transforms.warmup import warm_up_moe

        warm_up_moe(model, config.max_num_batched_tokens, device, dtype)
    # Captured graphs would replay one rank's collectives alone: several ranks run eagerly.
    if (device.type == "cuda" and attention == "triton" and graph_safe_moe and not eager
            and model.tp.size == 1 and model.tp.expert_parallel is None and not model.stage.pipelined):
        from engine.transforms.cuda_graphs import enable_decode_graphs

        enable_decode_graphs(runner, config.cuda_graph_batch_sizes, config.max_num_seqs, max_len)
    # Prefill and mixed steps: attention runs eagerly between the captured pieces, so either attention backend.
    if device.type == "cuda" and graph_safe_moe and not eager and model.tp.size == 1 \
            and model.tp.expert_parallel is None and not model.stage.pipelined and config.cuda_graph_token_sizes != ():
        from engine.transforms.piecewise_graphs import default_token_sizes, enable_piecewise_graphs

        enable_piecewise_graphs(runner, config.cuda_graph_token_sizes or default_token_sizes(config.max_num_batched_tokens))
    return runner


@dataclass(slots=True)
class RankParts:
    """What a rank builds: its model and runner, the KV pool every rank agreed on, and the context it allows."""

    model: MoECausalLM
    runner: ModelRunner
    cache_config: CacheConfig
    max_model_len: int
    dense_gemv_choices: list


def build_rank(config: EngineConfig, model_config: ModelConfig, kernels: KernelChoice, dtype: torch.dtype,
               device: torch.device, tp: TensorParallel, stage: PipelineStage = WHOLE) -> RankParts:
    """This rank's model (its stage's layers of it), KV pool and runner, the same steps on rank 0 and on every
    follower."""
    max_len = min(config.max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings)
    torch.manual_seed(config.seed)
    model, dense_gemv_choices = load_rank_model(config, model_config, kernels, dtype, device, max_len, tp, stage)
    draft = None
    if config.speculative == "draft":  # a single-process engine (EngineConfig checks)
        draft = load_draft_model(config, model_config, kernels, dtype, device, max_len)
    balancer = None
    if config.enable_eplb:  # before the KV pool is sized: the spare expert slots take memory
        from engine.eplb.balancer import ExpertBalancer

        blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        balancer = ExpertBalancer(blocks, tp.expert_parallel.tp, config.num_redundant_experts,
                                  config.eplb_window_steps, config.eplb_interval_steps, device)
    state_slots = state_slots_for_memory(config, model, device, dtype)
    num_blocks = kv_blocks_for_memory(config, model, device, dtype, draft,
                                      state_slots * state_bytes_per_slot(model, dtype))
    prefix_caching = config.enable_prefix_caching
    if state_slots:
        log_state_cache(model, state_slots, num_blocks, config.block_size, dtype)
        if prefix_caching:
            logger.info("prefix caching is off for this hybrid model: its cached blocks would carry no "
                        "linear-attention state to resume from")
            prefix_caching = False
    window = sliding_group_window(model)
    if window is not None:
        logger.info("KV cache: the %d-token sliding-window layers keep their own block tables, their blocks "
                    "returned to the pool as the window passes them", window)
    # A sequence never holds more than the whole pool. With a sliding group it holds a block there for each of
    # its own at most, and at most the window's and a step's besides.
    max_blocks = num_blocks
    if window is not None:
        bound = sliding_blocks_bound(window, config.block_size, config.max_num_batched_tokens)
        max_blocks = max(num_blocks // 2, num_blocks - bound)
    max_len = min(max_len, max_blocks * config.block_size)
    cache_config = CacheConfig(config.block_size, num_blocks, prefix_caching, window, state_slots)
    runner = make_runner(config, model, cache_config, kernels, device, dtype, max_len)
    runner.micro_batches = config.pipeline_micro_batches
    if config.overlaps_pipeline_steps and model.stage.is_first:
        runner.stage_zero = StageZeroSteps(runner)
    if draft is not None:
        runner.draft = DraftProposer(draft, cache_config, device, dtype, kernels.attention)
    runner.eplb = balancer
    return RankParts(model, runner, cache_config, max_len, dense_gemv_choices)
