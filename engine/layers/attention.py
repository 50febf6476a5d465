"""Self-attention block over the paged KV cache: packed qkv projection, optional q/k norms, RoPE."""

import torch
from torch import nn

from engine.worker.attention_metadata import AttentionMetadata, TritonAttentionMetadata
from engine.layers.norms import RMSNorm
from engine.layers.paged_attention import paged_attention, write_kv
from engine.layers.rotary import RotaryEmbedding
from engine.kernels.elementwise import rope_inplace
from engine.kernels.attention import triton_paged_attention


class Attention(nn.Module):
    """Legend: T tokens, H hidden, h query heads, kvh KV heads, d head dim.

    ``qk_norm``: "none"; "per_head" (Qwen3: RMSNorm over d of each head);
    "full" (OLMoE: RMSNorm over all heads' projections before the split).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        rms_norm_eps: float,
        qkv_bias: bool = False,
        qk_norm: str = "none",
        clip_qkv: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        # Packed q, k, v rows: one matmul instead of three (loaded from q_proj/k_proj/v_proj).
        self.qkv_proj = nn.Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, hidden_size, bias=False)
        self.rotary = rotary
        self.qk_norm = qk_norm
        self.clip_qkv = clip_qkv
        if qk_norm == "per_head":
            self.q_norm = RMSNorm(head_dim, rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, rms_norm_eps)
        elif qk_norm == "full":
            self.q_norm = RMSNorm(self.q_size, rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size, rms_norm_eps)
        else:
            assert qk_norm == "none", qk_norm
        self.scale = head_dim**-0.5
        # Set by engine.transforms.fusion: q/k norms and RoPE in one Triton pass over the packed projection.
        self.fused_rope = False
        # [N_blocks, block_size, kvh, d] each; bound by the runner once the pool is allocated.
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] = (torch.empty(0), torch.empty(0))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata | TritonAttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, q + 2kv]
        if self.fused_rope and self.qk_norm != "full" and self.clip_qkv is None:
            q, k, v = self._fused_norm_rope(qkv, positions)
        else:
            q, k, v = self._norm_rope(qkv, positions)
        k_cache, v_cache = self.kv_cache
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        # The metadata's type is the backend the runner chose (``KernelChoice.attention``).
        if isinstance(meta, TritonAttentionMetadata):
            out = triton_paged_attention(q, k_cache, v_cache, meta, self.scale)  # [T, h, d]
        else:
            out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(x.shape[0], self.q_size))

    def _fused_norm_rope(self, qkv: torch.Tensor, positions: torch.Tensor):
        # q heads then k heads are adjacent columns of qkv: one launch rotates (and normalizes) both, in place.
        per_head = self.qk_norm == "per_head"
        rope_inplace(
            qkv, self.num_heads + self.num_kv_heads, self.num_heads, positions, self.rotary.cos_cache,
            self.rotary.sin_cache, self.head_dim, self.q_norm.weight if per_head else None,
            self.k_norm.weight if per_head else None, self.q_norm.eps if per_head else 0.0,
        )
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.reshape(num_tokens, self.num_heads, self.head_dim), k.reshape(num_tokens, self.num_kv_heads, self.head_dim),
                v.reshape(num_tokens, self.num_kv_heads, self.head_dim))

    def _norm_rope(self, qkv: torch.Tensor, positions: torch.Tensor):
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)  # [T, h, d]
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # [T, kvh, d]
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return q, k, v
