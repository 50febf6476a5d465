"""A rank's model from an ``EngineConfig`` and the sizes it decides (dtype, KV pool, state slots, attention
backend): the steps ``engine.ranks.rank_builder`` takes on rank 0 and on follower ranks alike."""

import logging
from dataclasses import replace

import torch

from engine.core.config import CacheConfig, EngineConfig, KernelChoice
from engine.core.kv_cache_manager import sliding_blocks_bound
from engine.distributed.collectives import SINGLE, TensorParallel
from engine.distributed.pipeline import WHOLE, PipelineStage
from engine.core.model_config import CheckpointError, ModelConfig, load_model_config
from engine.loading.model_loader import build_model
from engine.loading.quantization import check_supported, resolve_scheme
from engine.models import MoECausalLM
from engine.worker.cache_groups import kv_bytes_per_block, sliding_group_window
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
    return load_model_config(config.model, config.language_model_only)


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
    if config.kv_cache_dtype == "fp8":  # before the caches are sized and allocated from the layers' specs
        for attn in model.attention_layers():
            attn.fp8_cache = True
    if kernels.attention == "triton":  # the linear-attention layers' rules too (``engine.kernels.delta_rule``)
        for layer in linear_layers(model):
            if hasattr(layer, "rule_kernel"):  # DeepSeek-V4's compressed attention keeps a state but no such rule
                layer.rule_kernel = "triton"
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


def state_checkpoints_for_memory(config: EngineConfig, model: MoECausalLM, device: torch.device, dtype: torch.dtype,
                                 state_slots: int) -> int:
    """A hybrid model's prefix-cache state checkpoints (``engine.core.state_checkpoints``): as many as
    ``state_checkpoint_share`` of the memory the KV blocks and the checkpoints share holds (with ``num_kv_blocks``
    fixed, that share beside those blocks); 0 where it holds none, or without prefix caching."""
    per_slot = state_bytes_per_slot(model, dtype)
    share = config.state_checkpoint_share
    if not per_slot or not config.enable_prefix_caching or share == 0:
        return 0
    if config.num_kv_blocks:
        kv_bytes = config.num_kv_blocks * kv_bytes_per_block(model, config.block_size, dtype)
        shared = kv_bytes / (1 - share)
    else:
        shared = _memory_budget(config, device) - state_slots * per_slot
    return _agree(model, max(int(share * shared // per_slot), 0))


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
    logger.info("state cache: %d slots (one per running request) of %.2f MiB over %d layers keeping a state "
                "= %.1f MiB; KV cache: %d blocks of %d tokens, %.3f MiB each over %d paged layers = %.1f MiB",
                slots, per_slot / 2**20, len(linear_layers(model)), slots * per_slot / 2**20, num_blocks, block_size,
                per_block / 2**20, len(model.attention_layers()), num_blocks * per_block / 2**20)


def log_state_checkpoints(model: MoECausalLM, checkpoints: int, block_size: int, interval: int,
                          dtype: torch.dtype) -> None:
    """What a prefix-cache state checkpoint costs, said at start: its bytes, in KV blocks, and per cached block."""
    per_slot = state_bytes_per_slot(model, dtype)
    per_block = kv_bytes_per_block(model, block_size, dtype)
    logger.info("prefix cache: %d state checkpoints of %.3f MiB (the KV bytes of %.1f blocks) = %.1f MiB, one "
                "after each prompt's last full block and every %d blocks: at most %.3f MiB of checkpoint per "
                "cached %d-token block on top of its %.3f MiB of KV", checkpoints, per_slot / 2**20,
                per_slot / per_block, checkpoints * per_slot / 2**20, interval, per_slot / interval / 2**20,
                block_size, per_block / 2**20)


def size_kv_pool(config: EngineConfig, model: MoECausalLM, device: torch.device, dtype: torch.dtype,
                 draft: MoECausalLM | None, max_len: int) -> tuple[CacheConfig, int]:
    """The KV pool (and a hybrid model's state slots) this rank's memory holds, every rank agreeing, and the
    context length it allows (at most ``max_len``)."""
    state_slots = state_slots_for_memory(config, model, device, dtype)
    checkpoints = state_checkpoints_for_memory(config, model, device, dtype, state_slots) if state_slots else 0
    num_blocks = kv_blocks_for_memory(config, model, device, dtype, draft,
                                      (state_slots + checkpoints) * state_bytes_per_slot(model, dtype))
    prefix_caching = config.enable_prefix_caching
    if state_slots:
        log_state_cache(model, state_slots, num_blocks, config.block_size, dtype)
        if checkpoints:
            log_state_checkpoints(model, checkpoints, config.block_size, config.state_checkpoint_interval, dtype)
        elif prefix_caching:
            logger.info("prefix caching is off for this hybrid model: state_checkpoint_share leaves no room for one "
                        "checkpoint of its linear-attention state, which a hit resumes from")
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
    cache_config = CacheConfig(config.block_size, num_blocks, prefix_caching, window, num_state_slots=state_slots,
                               num_state_checkpoints=checkpoints,
                               state_checkpoint_interval=config.state_checkpoint_interval,
                               eviction_policy=config.kv_eviction_policy)
    return cache_config, min(max_len, max_blocks * config.block_size)
