"""Binding a rank's caches into its model's layers: the KV cache tensors each attention layer reads (one per
cache-group slot) and a hybrid model's state rows; the runner and the draft model own what is returned."""

import torch

from engine.core.config import CacheConfig
from engine.models import MoECausalLM
from engine.worker.cache_groups import cache_slots
from engine.worker.kv_memory import zeros_on_first_touch
from engine.worker.state_cache import attach_state_caches


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
                                        spec.entry_dtype(i, dtype)) for i, shape in enumerate(spec.per_token))
        attn.kv_cache = by_slot[slot]
        caches.append(attn.kv_cache)
    return caches


def attach_caches(model: MoECausalLM, cache_config: CacheConfig, device: torch.device,
                  dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    """The KV caches (``attach_kv_caches``) and a hybrid model's state slots (``cache_config.num_state_slots``),
    bound into ``model``; returns the KV caches, which the runner and the prefix-cache tiers read."""
    caches = attach_kv_caches(model, cache_config, device, dtype)
    if cache_config.num_state_slots:  # the prefix cache's state checkpoints in the rows after the slots
        attach_state_caches(model, cache_config.num_state_slots + cache_config.num_state_checkpoints, device, dtype)
    return caches
