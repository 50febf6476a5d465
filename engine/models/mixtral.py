"""Mixtral: GQA attention, softmax top-k routing renormalised over the chosen experts."""

from engine.core.model_config import ModelConfig
from engine.distributed.collectives import TensorParallel
from engine.layers.attention import Attention
from engine.layers.moe import SparseMoeBlock
from engine.layers.rotary import RotaryEmbedding
from engine.models.base import DecoderLayer, MoECausalLM
from moe_kernels import RoutingSpec


def mixtral_moe(c: ModelConfig, moe_backend: str, tp: TensorParallel, **options) -> SparseMoeBlock:
    """Mixtral's MoE block: ``num_local_experts`` experts of ``intermediate_size``, softmax top-k routing
    renormalised over the chosen experts; ``options``: ``SparseMoeBlock``'s others (gpt-oss: its activation and
    biases)."""
    return SparseMoeBlock(
        c.hidden_size,
        num_experts=c.cfg("num_local_experts"),
        routing=RoutingSpec(top_k=c.cfg("num_experts_per_tok"), renormalize=True),
        intermediate_size=c.cfg("intermediate_size"),
        backend=moe_backend,
        tp=tp,
        **options,
    )


class MixtralForCausalLM(MoECausalLM):
    # Checkpoints call the MoE block `block_sparse_moe` and its experts w1 (gate), w3 (up), w2 (down).
    name_aliases = ((".block_sparse_moe.", ".mlp."),)

    def build_layer(self, layer_idx: int, rotary: RotaryEmbedding, moe_backend: str) -> DecoderLayer:
        c = self.config
        attn = Attention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, rotary, c.rms_norm_eps, tp=self.tp)
        return DecoderLayer(c, attn, mixtral_moe(c, moe_backend, self.tp))
