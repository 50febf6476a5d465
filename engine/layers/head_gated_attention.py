"""Attention whose output is scaled per query head by a sigmoid gate read from the layer input (Step-3.7-Flash).

``g_proj`` [h, H] gives each query head one gate logit per token; the head's attention output is multiplied by
sigmoid(logit) before ``o_proj``. Everything else (packed qkv, per-head q/k norms, partial RoPE, a per-layer window,
the paged cache) is ``Attention``'s. The gate logit rides with its query head as one extra column of q from
``project`` to ``attend``, so the decoder layer's three-part forward (and the piecewise graphs that split it there)
carries it without a buffer of its own.
"""

import torch
from torch import nn

from engine.device_batch.attention_metadata import AttentionMetadata, TritonAttentionMetadata
from engine.layers.attention import Attention


class HeadGatedAttention(Attention):
    """Legend: T tokens, H hidden, h query heads, kvh KV heads, d head dim. Takes ``Attention``'s arguments, plus
    ``scale`` (the softmax scale: Step-3.7-Flash's ``query_pre_attn_scalar ** -0.5``). Tensor parallel: ``g_proj``'s
    rows are split with the query heads (this rank's heads' gates)."""

    def __init__(self, *args, scale: float | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.g_proj = nn.Linear(self.qkv_proj.in_features, self.num_heads, bias=False)  # [h, H], this rank's heads
        if scale is not None:
            self.scale = scale

    def project_shapes(self) -> tuple[tuple[int, ...], ...]:
        q, k, v = super().project_shapes()
        return (q[0], q[1] + 1), k, v

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x [T, H] -> q with its gate logit [T, h, d + 1], k and v [T, kvh, d]."""
        q, k, v = super().project(x, positions)
        gate = self.g_proj(x).unsqueeze(-1)  # [T, h, 1]
        return torch.cat([q, gate.to(q.dtype)], dim=-1), k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: AttentionMetadata | TritonAttentionMetadata) -> torch.Tensor:
        """q [T, h, d + 1] (the gate logit last), k, v [T, kvh, d] -> the gated attention output [T, h, d]."""
        out = super().attend(q[..., :-1].contiguous(), k, v, meta)  # [T, h, d]
        return out * torch.sigmoid(q[..., -1:])
