"""GLM-4.5 / 4.6 / 4.7 and -Air: qkv bias, optional per-head q/k norm, partial rotary (half of each head by
default), sigmoid routing with a correction bias over expert groups, ungated shared experts, dense first
layers. The next-token-prediction layer after the last one is not loaded (``MoECausalLM.extra_layer``)."""

from engine.layers.attention import Attention
from engine.layers.rotary import RotaryEmbedding
from engine.models.base import DecoderLayer, MoECausalLM
from engine.models.deepseek_moe import DEEPSEEK_MOE_ALIASES, deepseek_mlp


class Glm4MoeForCausalLM(MoECausalLM):
    name_aliases = DEEPSEEK_MOE_ALIASES

    def build_layer(self, layer_idx: int, rotary: RotaryEmbedding, moe_backend: str) -> DecoderLayer:
        c = self.config
        attn = Attention(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, rotary, c.rms_norm_eps, tp=self.tp,
            qkv_bias=bool(c.cfg("attention_bias", False)), qk_norm="per_head" if c.cfg("use_qk_norm") else "none",
        )
        return DecoderLayer(c, attn, deepseek_mlp(c, layer_idx, moe_backend, tp=self.tp))
