"""Kimi-Linear: Kimi Delta Attention (linear, a fixed-size state per request) : multi-head latent attention
3:1 (``layer_types``), the latent attention without positions; a dense first MLP (``mlp_layer_types``), then
routed experts picked by bias-corrected grouped sigmoid scores (renormalised, scaled) beside an ungated shared
expert.

Both mixers sit under ``self_attn`` in the checkpoint. The latent-attention layers are the model's
``attention_layers()`` (a latent row per token in the paged cache, as DeepSeek's); the KDA layers are
``linear_layers()``, whose states the runner allocates in slots (``engine.worker.state_cache``), as for the
Qwen3-Next family (``engine.models.hybrid``). The published checkpoints name the MoE ``block_sparse_moe`` with
experts ``w1``/``w2``/``w3``, and the config uses its own names for the routing fields (``num_experts``,
``num_experts_per_token``, ``moe_renormalize``, ``num_expert_group``, ``num_shared_experts``), which
transformers' config maps to the usual ones read here.

Tensor parallel: each rank holds a run of the KDA layers' heads (``KimiDeltaAttention.tp_slices``), of the latent
layers' heads (as DeepSeek's) and of the MLPs' intermediate size; the layers' outputs are summed over the ranks.
"""

import torch
from torch import nn

from engine.core.model_config import ModelConfig
from engine.device_batch.attention_metadata import AttentionMetadata
from engine.distributed.collectives import SINGLE, TensorParallel
from engine.layers.kda import KimiDeltaAttention
from engine.layers.mla_nope import NoPositionMLAttention
from engine.layers.mlp import GatedMLP
from engine.layers.moe import SparseMoeBlock
from engine.layers.rotary import RotaryEmbedding
from engine.models.base import DecoderLayer, MoECausalLM, WeightRule
from engine.models.deepseek_moe import DEEPSEEK_MOE_ALIASES, is_dense_layer
from moe_kernels import RoutingSpec


class KimiDecoderLayer(DecoderLayer):
    """A decoder layer whose ``self_attn`` is a ``KimiDeltaAttention`` (over the request's state) or a
    ``NoPositionMLAttention`` (over the paged latent cache); the norms and MLP are ``DecoderLayer``'s."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H], residual [T, H] or None -> (this layer's MLP output, the residual sum)."""
        if not isinstance(self.self_attn, KimiDeltaAttention):
            return super().forward(x, residual, positions, meta)
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, meta.states), residual)
        return self.mlp(h), residual


def kimi_mlp(config: ModelConfig, layer_idx: int, moe_backend: str, tp: TensorParallel = SINGLE) -> nn.Module:
    """Layer ``layer_idx``'s MLP: dense SwiGLU where ``mlp_layer_types`` says "dense", else the routed experts
    (sigmoid scores plus a correction bias choose them, within the best groups) and the shared experts."""
    c = config
    if is_dense_layer(c, layer_idx):
        return GatedMLP(c.hidden_size, c.cfg("intermediate_size"), tp)
    n_group = int(c.cfg("n_group") or 1)
    routing = RoutingSpec(
        top_k=c.cfg("num_experts_per_tok"), scoring="sigmoid", renormalize=bool(c.cfg("norm_topk_prob", False)),
        n_group=n_group, topk_group=int(c.cfg("topk_group") or 1) if n_group > 1 else 1, group_scoring="top2_sum",
        scaling_factor=float(c.cfg("routed_scaling_factor", 1.0) or 1.0),
    )
    inter = c.cfg("moe_intermediate_size")
    return SparseMoeBlock(c.hidden_size, num_experts=c.cfg("num_local_experts"), routing=routing,
                          intermediate_size=inter, backend=moe_backend,
                          shared_expert_size=inter * (c.cfg("n_shared_experts") or 0), shared_expert_gated=False,
                          correction_bias=True, router_float32=True, tp=tp)


class KimiLinearForCausalLM(MoECausalLM):
    # The MoE under its published name; then DeepSeek's shared-expert and correction-bias names.
    name_aliases = ((".block_sparse_moe.", ".mlp."), *DEEPSEEK_MOE_ALIASES)
    # q, k, v keep their names in both mixers (KDA convolves each apart; MLA has its own q_proj).
    weight_rules = (WeightRule(r"^(.*\.self_attn\.[qkv]_proj\.weight)$", r"\1"),)

    def build_layer(self, layer_idx: int, rotary: RotaryEmbedding, moe_backend: str) -> DecoderLayer:
        c = self.config
        if layer_idx in c.linear_layers:
            mixer = KimiDeltaAttention(c.hidden_size, c.cfg("linear_num_heads"), c.cfg("linear_head_dim"),
                                       c.cfg("linear_conv_kernel_dim"), c.rms_norm_eps, tp=self.tp)
        else:
            nope, rope = c.cfg("qk_nope_head_dim"), c.cfg("qk_rope_head_dim")
            mixer = NoPositionMLAttention(
                c.hidden_size, c.num_heads, c.cfg("q_lora_rank"), c.cfg("kv_lora_rank"), nope, rope,
                c.cfg("v_head_dim"), rotary, rope_interleave=False, scale=(nope + rope) ** -0.5,
                bias=bool(c.cfg("attention_bias", False)), tp=self.tp,
            )
        return KimiDecoderLayer(c, mixer, kimi_mlp(c, layer_idx, moe_backend, self.tp))

    def attention_layers(self) -> list[nn.Module]:
        """The latent-attention layers: the paged cache is theirs."""
        return [layer.self_attn for layer in self.local_layers() if not isinstance(layer.self_attn, KimiDeltaAttention)]

    def linear_layers(self) -> list[KimiDeltaAttention]:
        """The KDA layers: each keeps a state per running request."""
        return [layer.self_attn for layer in self.local_layers() if isinstance(layer.self_attn, KimiDeltaAttention)]
