"""Full attention with a per-head output gate (the full-attention layers of Qwen3-Next and Qwen3.5).

``q_proj`` gives each query head its query and a gate side by side ([h, 2d]); the attention output is multiplied
by SigMoid(gate) before ``o_proj``. K and V, the per-head q/k norms, partial RoPE and the paged cache are those
of ``Attention``; q, k and v keep their own projections (the gate doubles q's rows, so they are not packed).
"""

import torch
from torch import nn

from engine.device_batch.attention_metadata import AttentionMetadata, TritonAttentionMetadata
from engine.distributed.collectives import SINGLE, TensorParallel
from engine.layers.attention import Attention
from engine.layers.rotary import RotaryEmbedding


class GatedAttention(Attention):
    """Legend: T tokens, H hidden, h query heads, kvh KV heads, d head dim (this rank's heads under tensor
    parallelism: ``Attention``'s split, one KV head replicated where there are fewer than ranks)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary: RotaryEmbedding,
                 rms_norm_eps: float, bias: bool = False, tp: TensorParallel = SINGLE) -> None:
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, rotary, rms_norm_eps, qk_norm="per_head",
                         o_bias=bias, tp=tp)
        del self.qkv_proj
        self.q_proj = nn.Linear(hidden_size, 2 * self.q_size, bias=bias)  # [query | gate] per head
        self.k_proj = nn.Linear(hidden_size, self.kv_size, bias=bias)
        self.v_proj = nn.Linear(hidden_size, self.kv_size, bias=bias)

    def tp_slices(self, local_name: str, rank: int) -> tuple[slice, ...] | None:
        """This rank's part of checkpoint tensor ``self_attn.<local_name>`` (None: whole, as the q/k norms)."""
        proj, _, kind = local_name.partition(".")
        if proj == "q_proj":  # [h * 2d] rows, [query | gate] per head: this rank's heads are one run
            n = 2 * self.q_size
            return (slice(rank * n, (rank + 1) * n),)
        if proj in ("k_proj", "v_proj"):
            replicated = self.total_kv_heads < self.tp.size
            first = rank * self.total_kv_heads // self.tp.size if replicated else rank * self.num_kv_heads
            return (slice(first * self.head_dim, (first + self.num_kv_heads) * self.head_dim),)
        if local_name == "o_proj.weight":  # [H, h * d]: this rank's heads' columns (the bias: rank 0 adds it)
            return (slice(None), slice(rank * self.q_size, (rank + 1) * self.q_size))
        return None

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | TritonAttentionMetadata) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        num_tokens = x.shape[0]
        q, gate = self.q_proj(x).view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)  # [T, h, d] each
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, self.q_norm(q.contiguous()), self.k_norm(k))
        out = self.attend(q, k, v, meta)  # [T, h, d]
        return self.output(out * torch.sigmoid(gate))
