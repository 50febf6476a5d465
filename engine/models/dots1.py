"""dots.llm1: per-head q/k norm, q/k/v and o_proj biases with ``attention_bias``, DeepSeek-V3's routing
(sigmoid, correction bias, expert groups) with ungated shared experts and dense first layers."""

from engine.core.model_config import ModelConfig
from engine.distributed.collectives import TensorParallel
from engine.layers.attention import Attention
from engine.layers.rotary import RotaryEmbedding
from engine.models.base import DecoderLayer, MoECausalLM
from engine.models.deepseek_moe import DEEPSEEK_MOE_ALIASES, deepseek_mlp


def qk_norm_attention(c: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel) -> Attention:
    """GQA with a per-head q/k norm, and q/k/v and o_proj biases with ``attention_bias`` (dots.llm1, Hy3)."""
    bias = bool(c.cfg("attention_bias", False))
    return Attention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, rotary, c.rms_norm_eps, tp=tp,
                     qkv_bias=bias, o_bias=bias, qk_norm="per_head")


class Dots1ForCausalLM(MoECausalLM):
    name_aliases = DEEPSEEK_MOE_ALIASES

    def build_layer(self, layer_idx: int, rotary: RotaryEmbedding, moe_backend: str) -> DecoderLayer:
        return DecoderLayer(self.config, qk_norm_attention(self.config, rotary, self.tp),
                            deepseek_mlp(self.config, layer_idx, moe_backend, tp=self.tp))
