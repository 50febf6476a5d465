"""Qwen3-MoE: RMSNorm on each head of q and k, optional renormalised top-k (`norm_topk_prob`)."""

from engine.layers.attention import Attention
from engine.layers.rotary import RotaryEmbedding
from engine.models.base import DecoderLayer, MoECausalLM
from engine.models.qwen_moe import qwen_mlp


class Qwen3MoeForCausalLM(MoECausalLM):
    def build_layer(self, layer_idx: int, rotary: RotaryEmbedding, moe_backend: str) -> DecoderLayer:
        c = self.config
        attn = Attention(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, rotary, c.rms_norm_eps, tp=self.tp,
            qkv_bias=bool(c.cfg("attention_bias", False)), qk_norm="per_head",
        )
        return DecoderLayer(c, attn, qwen_mlp(c, layer_idx, moe_backend, tp=self.tp))
