"""OLMoE: RMSNorm over the whole q and k projections, optional qkv clipping, 64 small experts."""

from engine.layers.attention import Attention
from engine.layers.moe import SparseMoeBlock
from engine.layers.rotary import RotaryEmbedding
from engine.models.base import DecoderLayer, MoECausalLM
from moe_kernels import RoutingSpec


class OlmoeForCausalLM(MoECausalLM):
    def build_layer(self, layer_idx: int, rotary: RotaryEmbedding, moe_backend: str) -> DecoderLayer:
        c = self.config
        attn = Attention(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, rotary, c.rms_norm_eps, tp=self.tp,
            qkv_bias=bool(c.cfg("attention_bias", False)), qk_norm="full", clip_qkv=c.cfg("clip_qkv"),
        )
        moe = SparseMoeBlock(
            c.hidden_size,
            num_experts=c.cfg("num_experts"),
            routing=RoutingSpec(top_k=c.cfg("num_experts_per_tok"), renormalize=bool(c.cfg("norm_topk_prob", False))),
            intermediate_size=c.cfg("intermediate_size"),
            backend=moe_backend,
            tp=self.tp,
        )
        return DecoderLayer(c, attn, moe)
