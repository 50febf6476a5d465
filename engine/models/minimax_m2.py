"""MiniMax-M2: RMSNorm over the whole q and k projections, partial rotary (``rotary_dim`` of each head),
every layer sparse: sigmoid scores with a correction bias choosing the top-k, weights renormalised."""

from engine.layers.attention import Attention
from engine.layers.moe import SparseMoeBlock
from engine.layers.rotary import RotaryEmbedding
from engine.models.base import DecoderLayer, MoECausalLM
from moe_kernels import RoutingSpec


class MiniMaxM2ForCausalLM(MoECausalLM):
    # Checkpoints call the MoE block `block_sparse_moe` and its experts w1 (gate), w3 (up), w2 (down).
    name_aliases = ((".block_sparse_moe.", ".mlp."),)

    def build_layer(self, layer_idx: int, rotary: RotaryEmbedding, moe_backend: str) -> DecoderLayer:
        c = self.config
        attn = Attention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, rotary, c.rms_norm_eps, tp=self.tp,
                         qk_norm="full")
        moe = SparseMoeBlock(
            c.hidden_size,
            num_experts=c.cfg("num_local_experts"),
            routing=RoutingSpec(top_k=c.cfg("num_experts_per_tok"), scoring="sigmoid", renormalize=True),
            intermediate_size=c.cfg("intermediate_size"),
            backend=moe_backend,
            correction_bias=True,
            tp=self.tp,
        )
        return DecoderLayer(c, attn, moe)
