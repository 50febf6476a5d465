"""Building an engine's prefix-cache tiers from its config, model and runner."""

import torch

from engine.core.config import EngineConfig
from engine.kv_tiers.block_copier import BlockCopier
from engine.kv_tiers.keys import checkpoint_identity, layout_fingerprint
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
    return TieredStore(copier, fingerprint, int(config.host_cache_gb * GB), config.disk_cache_dir,
                       int(config.disk_cache_gb * GB))
