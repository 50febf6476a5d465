"""MiniMax-M3's text model (``MiniMaxM3SparseForConditionalGeneration``, served as its language model: the tensors
under ``language_model.`` as published; the vision tower and projectors are skipped, the config's ``text_config`` is
the model's).

GQA with per-head q/k norms and the rope of ``rope_parameters``; the layers ``layer_types`` marks
"minimax_m3_sparse" attend only to the key blocks a block indexer keeps per query (MiniMax Sparse Attention:
``engine.layers.block_sparse_attention``), the others to every earlier key. Norms scale by (1 + weight). Dense layers
(``mlp_layer_types``, ``dense_intermediate_size``) and sparse ones: sigmoid routing with a correction bias,
renormalised and scaled (``routed_scaling_factor``), beside one ungated shared expert (``shared_intermediate_size``);
every MLP applies gpt-oss's clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``) to gate and up rows that are not
interleaved.
"""

from collections.abc import Callable

import torch

from engine.layers.attention import Attention
from engine.layers.block_indexer import BlockIndexer
from engine.layers.block_sparse_attention import BlockSparseAttention
from engine.layers.mlp import GatedMLP
from engine.layers.rotary import RotaryEmbedding
from engine.models.base import DecoderLayer, MoECausalLM, WeightRule
from engine.models.deepseek_moe import biased_sigmoid_moe
from engine.models.deepseek_v32 import SparseDecoderLayer
from moe_kernels.activation import ExpertActivation

SPARSE = "minimax_m3_sparse"
# Norms whose checkpoint weight w scales by (1 + w): loaded as 1 + w, so our RMSNorm applies them unchanged
# (the indexer's ``index_q_norm`` / ``index_k_norm`` end in ``q_norm.weight`` / ``k_norm.weight`` too).
_ZERO_CENTRED = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight")
# The image side of the published checkpoints (and of transformers' in-memory names): not served.
_IMAGE_PREFIXES = ("vision_tower.", "multi_modal_projector.", "patch_merge_mlp.", "model.vision_tower.",
                   "model.multi_modal_projector.")


class MiniMaxM3SparseForConditionalGeneration(MoECausalLM):
    """Checkpoint names as published (``language_model.model.*``, ``language_model.lm_head``, the MoE block as
    ``block_sparse_moe`` with experts ``w1``/``w3``/``w2``, the indexer's tensors as ``self_attn.index_*``) and as
    transformers names them in memory (``model.language_model.*``, ``self_attn.indexer.*``)."""

    name_aliases = (
        ("language_model.lm_head.", "lm_head."), ("model.language_model.", "model."),
        ("language_model.model.", "model."), (".block_sparse_moe.", ".mlp."),
        (".self_attn.index_", ".self_attn.indexer."), (".mlp.shared_experts.", ".mlp.shared_expert."),
        (".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias"),
    )
    # The indexer's q and k projections keep their names (not packed into a qkv_proj).
    weight_rules = (WeightRule(r"^(.*\.indexer\.[qk]_proj\.weight)$", r"\1"),)
    # Its sparse layers' attention takes more than the three projections CUDA graphs' static buffers hold.
    eager_only = True

    def build_layer(self, layer_idx: int, rotary: RotaryEmbedding, moe_backend: str) -> DecoderLayer:
        c = self.config
        args = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, rotary, c.rms_norm_eps)
        if (c.cfg("layer_types") or [])[layer_idx] == SPARSE:
            indexer = BlockIndexer(c.hidden_size, c.cfg("index_n_heads"), c.cfg("index_head_dim"),
                                   c.cfg("index_block_size"), c.cfg("index_topk_blocks"), c.cfg("index_local_blocks"),
                                   c.rms_norm_eps)
            attn = BlockSparseAttention(*args, qk_norm="per_head", tp=self.tp, indexer=indexer)
        else:
            attn = Attention(*args, qk_norm="per_head", tp=self.tp)
        act = ExpertActivation("clamped_swiglu", float(c.cfg("swiglu_alpha", 1.702)), float(c.cfg("swiglu_limit", 7.0)))
        kinds = c.cfg("mlp_layer_types") or ["sparse"] * c.num_layers
        if kinds[layer_idx] != "sparse":
            return SparseDecoderLayer(c, attn, GatedMLP(c.hidden_size, c.cfg("dense_intermediate_size"), self.tp,
                                                        activation=act))
        moe = biased_sigmoid_moe(c, moe_backend, self.tp, num_experts=c.cfg("num_local_experts"),
                                 intermediate_size=c.cfg("intermediate_size"),
                                 shared_expert_size=c.cfg("shared_intermediate_size") or 0,
                                 scaling_factor=float(c.cfg("routed_scaling_factor", 1.0) or 1.0), activation=act)
        return SparseDecoderLayer(c, attn, moe)

    def extra_layer(self, name: str) -> bool:
        """The image side, and the next-token-prediction module (``mtp.*``, or layers past ``num_hidden_layers``)."""
        if name.startswith(_IMAGE_PREFIXES) or ".mtp." in f".{name}":
            return True
        for old, new in self.name_aliases[:3]:
            name = name.replace(old, new)
        return super().extra_layer(name)

    def checkpoint_layout(self, name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        if name.endswith(_ZERO_CENTRED):
            return lambda w: w + 1.0
        return None
