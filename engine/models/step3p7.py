"""Step-3.7-Flash's text model (``Step3p7ForConditionalGeneration``, served as its language model: the tensors under
``model.language_model.``; the vision tower and projector are skipped, the config's ``text_config`` is the model's).

Sliding-window and full-attention layers (``layer_types``, 3:1 in the published model); the sliding layers have
their own query head count (``num_sliding_attention_heads``, the same KV heads), each layer kind its own rope
(``rope_parameters`` keyed by layer type: theta and a partial rotary factor). Every head's output is scaled by a
sigmoid gate read from the layer input (``g_proj``, ``engine.layers.head_gated_attention``); per-head q/k norms; the
softmax scale is ``query_pre_attn_scalar ** -0.5``. Norms scale by (1 + weight). Dense first layers
(``mlp_layer_types``), then sigmoid routing with a correction bias, renormalised and scaled
(``moe_router_scaling_factor``), beside one ungated shared expert (``share_expert_dim``). ``swiglu_limits`` and
``swiglu_limits_shared`` clamp, per layer, the routed experts' and the shared expert's (and a dense layer's) SwiGLU:
silu(gate) from above, up on both sides (``moe_kernels.activation``'s ``clamped_silu``).
"""

from collections.abc import Callable

import torch

from engine.core.model_config import CheckpointError
from engine.layers.head_gated_attention import HeadGatedAttention
from engine.layers.mlp import GatedMLP
from engine.layers.rotary import RotaryEmbedding
from engine.models.base import DecoderLayer, MoECausalLM, WeightRule, layer_kind_rotary
from engine.models.deepseek_moe import DEEPSEEK_MOE_ALIASES, biased_sigmoid_moe
from moe_kernels.activation import SILU, ExpertActivation

SLIDING = "sliding_attention"
# Norms whose checkpoint weight w scales by (1 + w): loaded as 1 + w, so our RMSNorm applies them unchanged.
_ZERO_CENTRED = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight",
                 "model.norm.weight")


def _clamp(limits: list | None, layer_idx: int) -> ExpertActivation:
    """The SwiGLU of layer ``layer_idx`` from a per-layer list of bounds (None or 0: no clamp)."""
    limit = limits[layer_idx] if limits else None
    return ExpertActivation("clamped_silu", limit=float(limit)) if limit else SILU


class Step3p7ForConditionalGeneration(MoECausalLM):
    """Checkpoint names as published (and as transformers saves them): the language model under ``model.``, each
    MoE layer's router, correction bias and stacked experts under ``moe.`` (``gate_proj`` and ``up_proj`` [E, I, H],
    ``down_proj`` [E, H, I]), its shared expert under ``share_expert.``; transformers' in-memory names
    (``model.language_model.``, ``mlp.experts.gate_up_proj``, ``mlp.shared_experts.``) are read too."""

    name_aliases = (("model.language_model.", "model."), (".moe.gate.weight", ".mlp.gate.weight"),
                    (".moe.router_bias", ".mlp.e_score_correction_bias"), (".share_expert.", ".mlp.shared_expert."),
                    *DEEPSEEK_MOE_ALIASES)
    weight_rules = (
        WeightRule(r"^(.*)\.moe\.gate_proj\.weight$", r"\1.mlp.experts.w13", 0),
        WeightRule(r"^(.*)\.moe\.up_proj\.weight$", r"\1.mlp.experts.w13", 1),
        WeightRule(r"^(.*)\.moe\.down_proj\.weight$", r"\1.mlp.experts.w2"),
    )

    def build_layer(self, layer_idx: int, rotary: RotaryEmbedding, moe_backend: str) -> DecoderLayer:
        c = self.config
        self._check_supported()
        kind = c.cfg("layer_types")[layer_idx]
        heads = int(c.cfg("num_sliding_attention_heads") or c.num_heads) if kind == SLIDING else c.num_heads
        bias = bool(c.cfg("attention_bias", False))
        attn = HeadGatedAttention(
            c.hidden_size, heads, c.num_kv_heads, c.head_dim, self._rotary(kind, rotary.max_positions),
            c.rms_norm_eps, qkv_bias=bias, o_bias=bias, qk_norm="per_head", tp=self.tp,
            sliding_window=c.own_window(layer_idx), scale=float(c.cfg("query_pre_attn_scalar") or c.head_dim) ** -0.5,
        )
        shared_act = _clamp(c.cfg("swiglu_limits_shared"), layer_idx)
        if c.cfg("mlp_layer_types")[layer_idx] != "sparse":
            return DecoderLayer(c, attn, GatedMLP(c.hidden_size, c.cfg("intermediate_size"), self.tp,
                                                  activation=shared_act))
        moe = biased_sigmoid_moe(c, moe_backend, self.tp, num_experts=c.cfg("n_routed_experts"),
                                 intermediate_size=c.cfg("moe_intermediate_size"),
                                 shared_expert_size=c.cfg("share_expert_dim"),
                                 scaling_factor=float(c.cfg("moe_router_scaling_factor", 1.0) or 1.0),
                                 activation=_clamp(c.cfg("swiglu_limits"), layer_idx), shared_activation=shared_act)
        return DecoderLayer(c, attn, moe)

    def _check_supported(self) -> None:
        c = self.config
        if c.cfg("use_bidirectional_attention", False):
            raise CheckpointError("config.json use_bidirectional_attention=true is not supported for Step-3.7-Flash "
                                  "(a causal language model attends causally)")
        if c.cfg("mlp_bias", False):
            raise CheckpointError("config.json mlp_bias=true is not supported for Step-3.7-Flash")
        if c.cfg("gating", True) not in (True, "per-head"):
            raise CheckpointError(f"config.json gating={c.cfg('gating')!r} is not supported for Step-3.7-Flash "
                                  "(only a per-head output gate)")

    def _rotary(self, kind: str, max_positions: int) -> RotaryEmbedding:
        """The rope of one layer kind (its own theta and rotated width), shared by the layers of that kind."""
        return layer_kind_rotary(self, kind, max_positions, "Step-3.7-Flash")

    def extra_layer(self, name: str) -> bool:
        """The vision tower and projector, and the next-token-prediction layers past ``num_hidden_layers``."""
        if name.startswith(("vision_model.", "vit_large_projector.", "model.vision_model.",
                            "model.multi_modal_projector.")):
            return True
        return super().extra_layer(name.replace("model.language_model.", "model.", 1))

    def checkpoint_layout(self, name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        if name.endswith(_ZERO_CENTRED):
            return lambda w: w + 1.0
        return None
