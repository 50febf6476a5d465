"""What the hybrid linear-attention families share (Qwen3-Next, Qwen3.5-MoE): Gated DeltaNet layers with a
fixed-size state per request, and every few layers (``layer_types``) a gated full-attention layer over the paged
KV cache; norms that scale by (1 + weight); routed experts with a sigmoid-gated shared expert.

The full-attention layers are the model's ``attention_layers()`` (their KV caches are sized and allocated as
every family's); the linear ones are ``linear_layers()``, whose states the runner allocates in slots
(``engine.worker.state_cache``) and whose slots the scheduler hands out (``engine.core.state_slots``).
"""

import abc
from collections.abc import Callable

import torch
from torch import nn

from engine.device_batch.attention_metadata import AttentionMetadata
from engine.layers.gated_attention import GatedAttention
from engine.layers.gated_deltanet import GatedDeltaNet
from engine.layers.rotary import RotaryEmbedding
from engine.models.base import DecoderLayer, MoECausalLM, WeightRule
from engine.models.qwen_moe import qwen_mlp

# Norms whose checkpoint weight w scales by (1 + w): loaded as 1 + w, so our RMSNorm applies them unchanged.
_ZERO_CENTRED = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight")


class HybridDecoderLayer(DecoderLayer):
    """A decoder layer whose mixer is a ``GatedAttention`` (``self_attn``) or a ``GatedDeltaNet``
    (``linear_attn``), named as in the checkpoint; the norms and MLP are ``DecoderLayer``'s."""

    def __init__(self, config, mixer: nn.Module, mlp: nn.Module) -> None:
        super().__init__(config, mixer, mlp)
        if isinstance(mixer, GatedDeltaNet):
            del self.self_attn
            self.linear_attn = mixer

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H], residual [T, H] or None -> (this layer's MLP output, the residual sum)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        if hasattr(self, "linear_attn"):
            h = self.linear_attn(h, meta.states)
        else:
            h = self.self_attn(h, positions, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class HybridCausalLM(MoECausalLM, abc.ABC):
    """Base of the hybrid families: a family says how its Gated DeltaNet lays out its input projections."""

    deltanet_layout: str = "per_key_head"
    # Whether the router renormalises its top-k weights (None: the config's ``norm_topk_prob``).
    renormalize: bool | None = None
    # q, k, v of the gated attention keep their names (not packed into qkv_proj: the gate doubles q).
    weight_rules = (WeightRule(r"^(.*\.self_attn\.[qkv]_proj\.(?:weight|bias))$", r"\1"),)

    def build_layer(self, layer_idx: int, rotary: RotaryEmbedding, moe_backend: str) -> DecoderLayer:
        c = self.config
        if layer_idx in c.linear_layers:
            mixer = GatedDeltaNet(c.hidden_size, c.cfg("linear_num_key_heads"), c.cfg("linear_num_value_heads"),
                                  c.cfg("linear_key_head_dim"), c.cfg("linear_value_head_dim"),
                                  c.cfg("linear_conv_kernel_dim"), c.rms_norm_eps, self.deltanet_layout, tp=self.tp)
        else:
            mixer = GatedAttention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, rotary, c.rms_norm_eps,
                                   bias=bool(c.cfg("attention_bias", False)), tp=self.tp)
        shared = c.cfg("shared_expert_intermediate_size", 0) or 0
        return HybridDecoderLayer(c, mixer, qwen_mlp(c, layer_idx, moe_backend, shared_expert_size=shared, tp=self.tp,
                                                      renormalize=self.renormalize))

    def attention_layers(self) -> list[nn.Module]:
        """The full-attention layers: the KV cache is theirs."""
        return [layer.self_attn for layer in self.local_layers() if hasattr(layer, "self_attn")]

    def linear_layers(self) -> list[GatedDeltaNet]:
        """The linear-attention layers: each keeps a state per running request."""
        return [layer.linear_attn for layer in self.local_layers() if hasattr(layer, "linear_attn")]

    def extra_layer(self, name: str) -> bool:
        """Also the next-token-prediction module these checkpoints keep apart (``mtp.*``)."""
        return name.startswith("mtp.") or super().extra_layer(name)

    def checkpoint_layout(self, name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        # The final norm: ``model.norm`` (``model.language_model.norm`` in an image-text checkpoint).
        if name.endswith(_ZERO_CENTRED) or name.endswith("model.norm.weight"):
            return lambda w: w + 1.0
        return None
