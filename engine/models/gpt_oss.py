"""gpt-oss: attention with sinks, biases and a window on every other layer; experts with biases and a clamped
SwiGLU; a router with a bias, softmax over the chosen k (the same as softmax over all, then renormalised)."""

from collections.abc import Callable

import torch

from engine.layers.attention import Attention
from engine.layers.rotary import RotaryEmbedding
from engine.models.base import DecoderLayer, MoECausalLM
from engine.models.mixtral import mixtral_moe
from moe_kernels.activation import ExpertActivation


def _gate_up_rows(w: torch.Tensor) -> torch.Tensor:
    """[..., 2I, X] with gate and up rows interleaved (gate at even rows) -> gate rows, then up rows."""
    return torch.cat([w[..., 0::2, :], w[..., 1::2, :]], dim=-2)


def _gate_up_from_columns(w: torch.Tensor) -> torch.Tensor:
    """transformers' gate_up_proj [E, H, 2I] (gate at even columns) -> our w13 [E, 2I, H]."""
    return _gate_up_rows(w.transpose(1, 2)).contiguous()


def _gate_up_bias(b: torch.Tensor) -> torch.Tensor:
    """gate_up_proj_bias [E, 2I] interleaved -> w13_bias [E, 2I], gate then up."""
    return _gate_up_rows(b.unsqueeze(-1)).squeeze(-1).contiguous()


def _down_from_columns(w: torch.Tensor) -> torch.Tensor:
    """transformers' down_proj [E, I, H] -> our w2 [E, H, I]."""
    return w.transpose(1, 2).contiguous()


class GptOssForCausalLM(MoECausalLM):
    # Longer names first: each alias is a plain substring replacement.
    name_aliases = (
        (".mlp.router.", ".mlp.gate."),
        (".experts.gate_up_proj_bias", ".experts.w13_bias"),
        (".experts.down_proj_bias", ".experts.w2_bias"),
    )

    def build_layer(self, layer_idx: int, rotary: RotaryEmbedding, moe_backend: str) -> DecoderLayer:
        c = self.config
        bias = bool(c.cfg("attention_bias", True))
        attn = Attention(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, rotary, c.rms_norm_eps, tp=self.tp,
            qkv_bias=bias, o_bias=bias, sinks=True, sliding_window=c.own_window(layer_idx),
        )
        moe = mixtral_moe(c, moe_backend, self.tp, expert_bias=True, router_bias=True,
                          activation=ExpertActivation("clamped_swiglu", float(c.cfg("swiglu_alpha", 1.702)),
                                                      float(c.cfg("swiglu_limit", 7.0))))
        return DecoderLayer(c, attn, moe)

    def checkpoint_layout(self, name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        # MXFP4 experts (the published checkpoints), once dequantized: rows are output channels, [E, 2I, H]
        # interleaved and [E, H, I] already ours.
        if name.endswith(".experts.gate_up_proj_blocks"):
            return _gate_up_rows
        # Expert tensors in transformers' in-memory layout (bf16 checkpoints saved by transformers).
        if name.endswith(".experts.gate_up_proj"):
            return _gate_up_from_columns
        if name.endswith(".experts.gate_up_proj_bias"):
            return _gate_up_bias
        if name.endswith(".experts.down_proj"):
            return _down_from_columns
        return None
