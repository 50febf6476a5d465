"""DeepSeek-V2 / V3 (and Kimi-K2, Moonlight: the V3 architecture): multi-head latent attention, dense first
layers (``first_k_dense_replace``), routed experts plus ungated shared experts."""

import math

import torch

from engine.distributed.collectives import SINGLE, TensorParallel
from engine.layers.mla_attention import MLAttention
from engine.layers.mlp import GatedMLP
from engine.layers.moe import SparseMoeBlock
from engine.layers.rotary import RotaryEmbedding
from engine.loading.model_config import ModelConfig
from engine.models.base import DecoderLayer, MoECausalLM, WeightRule


def softmax_scale(config: ModelConfig) -> float:
    """``qk_head_dim ** -0.5``, times YaRN's attention factor squared when the rope is scaled with
    ``mscale_all_dim`` (the rope tables carry mscale / mscale_all_dim; the softmax makes up the rest)."""
    scale = (config.cfg("qk_nope_head_dim") + config.cfg("qk_rope_head_dim")) ** -0.5
    rope = config.rope_parameters
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim") and rope.get("factor", 1) > 1:
        mscale = 0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1.0
        scale *= mscale * mscale
    return scale


def mla_from_config(config: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel = SINGLE) -> MLAttention:
    c = config
    return MLAttention(
        c.hidden_size, c.num_heads, c.cfg("q_lora_rank"), c.cfg("kv_lora_rank"), c.cfg("qk_nope_head_dim"),
        c.cfg("qk_rope_head_dim"), c.cfg("v_head_dim"), rotary, rope_interleave=bool(c.cfg("rope_interleave", True)),
        scale=softmax_scale(c), bias=bool(c.cfg("attention_bias", False)), tp=tp,
    )


class DeepseekMoE(SparseMoeBlock):
    """Routed experts plus ``n_shared_experts`` shared ones (one MLP of that many times the expert size) that
    every token goes through, ungated."""

    def __init__(self, hidden_size: int, shared_expert_size: int, tp: TensorParallel = SINGLE, **routed) -> None:
        super().__init__(hidden_size, tp=tp, **routed)
        self.shared_expert = GatedMLP(hidden_size, shared_expert_size, tp, reduce=False) if shared_expert_size else None

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared_expert(x)  # [T, H], this rank's partial sum


def deepseek_mlp(config: ModelConfig, layer_idx: int, moe_backend: str, tp: TensorParallel) -> torch.nn.Module:
    c = config
    num_experts = c.cfg("n_routed_experts") or 0
    if layer_idx < (c.cfg("first_k_dense_replace") or 0) or not num_experts:
        return GatedMLP(c.hidden_size, c.cfg("intermediate_size"), tp)
    method = c.cfg("topk_method", "greedy")
    if c.architecture == "DeepseekV2ForCausalLM" and (method != "greedy" or c.cfg("routed_scaling_factor", 1.0) != 1.0):
        raise ValueError(f"DeepSeek-V2 routing {method!r} with routed_scaling_factor "
                         f"{c.cfg('routed_scaling_factor')} is not supported yet (greedy top-k with factor 1 is)")
    return DeepseekMoE(
        c.hidden_size, c.cfg("moe_intermediate_size") * (c.cfg("n_shared_experts") or 0), tp=tp,
        num_experts=num_experts, top_k=c.cfg("num_experts_per_tok"), intermediate_size=c.cfg("moe_intermediate_size"),
        # V2's router never renormalises its top-k weights (``norm_topk_prob`` is V3's).
        renormalize=c.architecture != "DeepseekV2ForCausalLM" and bool(c.cfg("norm_topk_prob", False)),
        backend=moe_backend,
    )


class DeepseekV2ForCausalLM(MoECausalLM):
    # MLA's own q_proj (no packed qkv); the checkpoints' ``shared_experts`` is our ``shared_expert``.
    weight_rules = (WeightRule(r"^(.*\.self_attn)\.q_proj\.weight$", r"\1.q_proj.weight"),)
    name_aliases = ((".mlp.shared_experts.", ".mlp.shared_expert."),)

    def build_layer(self, layer_idx: int, rotary: RotaryEmbedding, moe_backend: str) -> DecoderLayer:
        return DecoderLayer(self.config, mla_from_config(self.config, rotary, self.tp),
                            deepseek_mlp(self.config, layer_idx, moe_backend, self.tp))


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass
