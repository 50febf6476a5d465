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
from moe_kernels.routing import RoutingSpec


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


def deepseek_routing(config: ModelConfig) -> RoutingSpec:
    """V3: sigmoid scores, the correction bias choosing, top-2-sum groups, ``norm_topk_prob``, scaled. V2: softmax,
    ``group_limited_greedy`` groups scored by their best expert (``greedy``: no groups), never renormalised."""
    c = config
    common = dict(top_k=c.cfg("num_experts_per_tok"), scaling_factor=float(c.cfg("routed_scaling_factor", 1.0)))
    if c.architecture == "DeepseekV3ForCausalLM":
        return RoutingSpec(scoring="sigmoid", renormalize=bool(c.cfg("norm_topk_prob", True)),
                           n_group=c.cfg("n_group") or 1, topk_group=c.cfg("topk_group") or 1, **common)
    method = c.cfg("topk_method", "greedy")
    if method == "greedy":
        return RoutingSpec(**common)
    if method != "group_limited_greedy":
        raise ValueError(f"DeepSeek-V2 topk_method {method!r} is not supported (greedy, group_limited_greedy are)")
    return RoutingSpec(n_group=c.cfg("n_group"), topk_group=c.cfg("topk_group"), group_scoring="max", **common)


def deepseek_mlp(config: ModelConfig, layer_idx: int, moe_backend: str, tp: TensorParallel) -> torch.nn.Module:
    """Dense SwiGLU for the first ``first_k_dense_replace`` layers, then routed experts plus ``n_shared_experts``
    shared ones (one MLP of that many times the expert size) that every token goes through, ungated."""
    c = config
    num_experts = c.cfg("n_routed_experts") or 0
    if layer_idx < (c.cfg("first_k_dense_replace") or 0) or not num_experts:
        return GatedMLP(c.hidden_size, c.cfg("intermediate_size"), tp)
    return SparseMoeBlock(
        c.hidden_size, num_experts=num_experts, routing=deepseek_routing(c),
        intermediate_size=c.cfg("moe_intermediate_size"), backend=moe_backend,
        shared_expert_size=c.cfg("moe_intermediate_size") * (c.cfg("n_shared_experts") or 0),
        shared_expert_gated=False, correction_bias=c.architecture == "DeepseekV3ForCausalLM", tp=tp,
    )


class DeepseekV2ForCausalLM(MoECausalLM):
    # MLA's own q_proj (no packed qkv); the checkpoints' ``shared_experts`` is our ``shared_expert``, their
    # router's ``gate.e_score_correction_bias`` the block's.
    weight_rules = (WeightRule(r"^(.*\.self_attn)\.q_proj\.weight$", r"\1.q_proj.weight"),)
    name_aliases = ((".mlp.shared_experts.", ".mlp.shared_expert."),
                    (".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias"))

    def build_layer(self, layer_idx: int, rotary: RotaryEmbedding, moe_backend: str) -> DecoderLayer:
        return DecoderLayer(self.config, mla_from_config(self.config, rotary, self.tp),
                            deepseek_mlp(self.config, layer_idx, moe_backend, self.tp))


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass
