"""Shared layer plan of the Qwen MoE families: sparse layers every `decoder_sparse_step`, dense MLP elsewhere."""

from torch import nn

from engine.distributed.collectives import SINGLE, TensorParallel
from engine.layers.mlp import GatedMLP
from engine.layers.moe import SparseMoeBlock
from engine.core.model_config import ModelConfig
from moe_kernels import RoutingSpec


def qwen_mlp(config: ModelConfig, layer_idx: int, moe_backend: str, shared_expert_size: int = 0,
             tp: TensorParallel = SINGLE, renormalize: bool | None = None) -> nn.Module:
    """A layer is sparse unless listed in `mlp_only_layers` or off the `decoder_sparse_step` grid. ``renormalize``:
    whether the top-k weights are renormalised (None: as the config's `norm_topk_prob` says)."""
    num_experts = config.cfg("num_experts") or config.cfg("num_local_experts") or 0
    step = config.cfg("decoder_sparse_step", 1) or 1
    sparse = layer_idx not in (config.cfg("mlp_only_layers") or []) and num_experts > 0 and (layer_idx + 1) % step == 0
    if not sparse:
        return GatedMLP(config.hidden_size, config.cfg("intermediate_size"), tp)
    return SparseMoeBlock(
        config.hidden_size,
        num_experts=num_experts,
        routing=RoutingSpec(top_k=config.cfg("num_experts_per_tok"), renormalize=bool(
            config.cfg("norm_topk_prob", False) if renormalize is None else renormalize)),
        intermediate_size=config.cfg("moe_intermediate_size"),
        backend=moe_backend,
        shared_expert_size=shared_expert_size,
        tp=tp,
    )
