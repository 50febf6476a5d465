"""Building an engine's prefix-cache tiers from its config, model and runner."""

import torch

from engine.core.config import EngineConfig
from engine.kv_tiers.block_copier import BlockCopier
from engine.kv_tiers.keys import checkpoint_identity, layout_fingerprint
from engine.kv_tiers.rank_mirror import RankMirror
from engine.kv_tiers.store import TieredStore
from engine.models import MoECausalLM

GB = 1e9


def build_tiers(config: EngineConfig, model: MoECausalLM, kv_caches: list[tuple[torch.Tensor, ...]],
                device: torch.device, dtype: torch.dtype) -> TieredStore | None:
    """The host (and disk) tiers over ``kv_caches``, or None when ``host_cache_gb`` is 0."""
    if config.host_cache_gb <= 0:
        return None
    specs = []
    for attn in model.attention_layers():
        spec = attn.cache_spec()
        specs.append((str(spec.dtype or dtype), spec.per_token))
    identity = checkpoint_identity(config.model, config.random_weights, config.seed, config.quantization)
    fingerprint = layout_fingerprint(identity, str(dtype), specs, config.block_size, model.tp.size, model.tp.rank)
    copier = BlockCopier(kv_caches, device)
    return TieredStore(copier, fingerprint, host_bytes_per_rank(config, model.tp.size), config.disk_cache_dir,
                       int(config.disk_cache_gb * GB), config.deployment_id, config.kv_eviction_policy)


def host_bytes_per_rank(config: EngineConfig, tp_size: int) -> int:
    """``host_cache_gb`` is the engine's whole host tier: each tensor-parallel rank holds its slice of every
    block, so each gets an equal part (the same number of slots on every rank)."""
    return int(config.host_cache_gb * GB) // tp_size


def build_rank_mirror(config: EngineConfig, kv_caches: list[tuple[torch.Tensor, ...]], device: torch.device,
                      tp_size: int) -> RankMirror | None:
    """A follower rank's slice of the host tier, or None when ``host_cache_gb`` is 0."""
    if config.host_cache_gb <= 0:
        return None
    return RankMirror(kv_caches, device, host_bytes_per_rank(config, tp_size))
