"""Qwen2-MoE (Qwen1.5-MoE): qkv bias, routed experts plus a sigmoid-gated shared expert."""

from engine.layers.attention import Attention
from engine.layers.rotary import RotaryEmbedding
from engine.models.base import DecoderLayer, MoECausalLM
from engine.models.qwen_moe import qwen_mlp


class Qwen2MoeForCausalLM(MoECausalLM):
    def build_layer(self, layer_idx: int, rotary: RotaryEmbedding, moe_backend: str) -> DecoderLayer:
        c = self.config
        attn = Attention(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, rotary, c.rms_norm_eps, tp=self.tp,
            qkv_bias=bool(c.cfg("qkv_bias", True)),
        )
        shared = c.cfg("shared_expert_intermediate_size", 0) or 0
        return DecoderLayer(c, attn, qwen_mlp(c, layer_idx, moe_backend, shared_expert_size=shared, tp=self.tp))
