"""DeepSeek-V3.2: DeepSeek-V3 (multi-head latent attention, the DeepSeek MoE layer plan) whose attention reads only
the tokens a lightning indexer selects per query (DeepSeek Sparse Attention: ``engine.layers.sparse_mla_attention``).
GLM-5 (``engine.models.glm_moe_dsa``) is this family with interleaved indexer rope and layers that reuse the last
indexed layer's selection."""

import torch

from engine.core.model_config import CheckpointError
from engine.device_batch.attention_metadata import AttentionMetadata
from engine.layers.lightning_indexer import LightningIndexer
from engine.layers.rotary import RotaryEmbedding
from engine.layers.sparse_mla_attention import SelectionRelay, SparseMLAttention
from engine.models.base import DecoderLayer, MoECausalLM
from engine.models.deepseek import mla_from_config
from engine.models.deepseek_moe import DEEPSEEK_MOE_ALIASES, deepseek_mlp


class SparseDecoderLayer(DecoderLayer):
    """A decoder layer whose attention takes the indexer's projections beside MLA's (six tensors, not three)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        *projected, residual = self.pre_attention(x, residual, positions)
        return self.post_attention(self.self_attn.attend(*projected, meta), residual)


class DeepseekV32ForCausalLM(MoECausalLM):
    name_aliases = DEEPSEEK_MOE_ALIASES
    # The indexer's rope: half-split here (the MLA rope itself is interleaved, as DeepSeek-V3's).
    index_rope_interleave = False
    # Its attention takes more than the three projections CUDA graphs' static buffers hold: run eagerly.
    eager_only = True

    def indexed(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` runs its own indexer (every layer here)."""
        return True

    def build_layer(self, layer_idx: int, rotary: RotaryEmbedding, moe_backend: str) -> DecoderLayer:
        c = self.config
        if not c.cfg("q_lora_rank"):
            raise CheckpointError(f"{c.architecture} needs q_lora_rank: the indexer reads the query latent")
        if self.__dict__.get("relay") is None:  # one relay for every layer of the model
            self.relay = SelectionRelay()
        indexer = None
        if self.indexed(layer_idx):
            indexer = LightningIndexer(c.hidden_size, c.cfg("q_lora_rank"), c.cfg("index_n_heads"),
                                       c.cfg("index_head_dim"), c.cfg("qk_rope_head_dim"), c.cfg("index_topk"),
                                       self.index_rope_interleave)
        attn = mla_from_config(c, rotary, self.tp, SparseMLAttention, indexer=indexer, relay=self.relay,
                               index_head_dim=c.cfg("index_head_dim"))
        return SparseDecoderLayer(c, attn, deepseek_mlp(c, layer_idx, moe_backend, self.tp))
