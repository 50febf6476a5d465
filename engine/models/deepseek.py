"""DeepSeek-V2 / V3 (and Kimi-K2, Moonlight: the V3 architecture): multi-head latent attention over a latent
paged cache, with the DeepSeek MoE layer plan (``engine.models.deepseek_moe``: dense first layers, routed plus
ungated shared experts; V2's softmax routing, V3's bias-corrected grouped sigmoid routing)."""

import math


from engine.distributed.collectives import SINGLE, TensorParallel
from engine.layers.mla_attention import MLAttention
from engine.layers.rotary import RotaryEmbedding
from engine.core.model_config import ModelConfig
from engine.models.base import DecoderLayer, MoECausalLM, WeightRule
from engine.models.deepseek_moe import DEEPSEEK_MOE_ALIASES, deepseek_mlp


def softmax_scale(config: ModelConfig) -> float:
    """``qk_head_dim ** -0.5``, times YaRN's attention factor squared when the rope is scaled with
    ``mscale_all_dim`` (the rope tables carry mscale / mscale_all_dim; the softmax makes up the rest)."""
    scale = (config.cfg("qk_nope_head_dim") + config.cfg("qk_rope_head_dim")) ** -0.5
    rope = config.rope_parameters
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim") and rope.get("factor", 1) > 1:
        mscale = 0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1.0
        scale *= mscale * mscale
    return scale


def mla_from_config(config: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel = SINGLE,
                    cls: type[MLAttention] = MLAttention, **extra) -> MLAttention:
    """The config's MLA layer: ``cls`` (an ``MLAttention`` subclass) built with ``extra`` keyword arguments too."""
    c = config
    return cls(
        c.hidden_size, c.num_heads, c.cfg("q_lora_rank"), c.cfg("kv_lora_rank"), c.cfg("qk_nope_head_dim"),
        c.cfg("qk_rope_head_dim"), c.cfg("v_head_dim"), rotary, rope_interleave=bool(c.cfg("rope_interleave", True)),
        scale=softmax_scale(c), bias=bool(c.cfg("attention_bias", False)), tp=tp, **extra,
    )


class DeepseekV2ForCausalLM(MoECausalLM):
    # MLA's own q_proj (no packed qkv).
    weight_rules = (WeightRule(r"^(.*\.self_attn)\.q_proj\.weight$", r"\1.q_proj.weight"),)
    name_aliases = DEEPSEEK_MOE_ALIASES

    def build_layer(self, layer_idx: int, rotary: RotaryEmbedding, moe_backend: str) -> DecoderLayer:
        return DecoderLayer(self.config, mla_from_config(self.config, rotary, self.tp),
                            deepseek_mlp(self.config, layer_idx, moe_backend, self.tp))


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass
