"""Rotary position embedding (NeoX layout: rotate the two halves of each head's rotated part).

Partial rotary (GLM-4.5, MiniMax-M2: ``partial_rotary_factor`` in the rope parameters) rotates only the
first ``rotary_dim`` of each head's d dimensions (its two halves) and passes the rest through, as
transformers' ``apply_rotary_pos_emb`` does when cos/sin are narrower than the head.
"""

import torch
from torch import nn

from engine.core.model_config import ModelConfig


def rotary_dim(config: ModelConfig, head_dim: int) -> int:
    """How many of each head's ``head_dim`` dimensions are rotated (all, unless a partial factor is set)."""
    factor = float(config.rope_parameters.get("partial_rotary_factor", 1.0) or 1.0)
    dim = int(head_dim * factor)
    if not 0 < dim <= head_dim or dim % 2:
        raise ValueError(f"partial_rotary_factor {factor} gives {dim} rotated dims of {head_dim}: need an even "
                         "number in (0, head_dim]")
    return dim


def _inv_freq(config: ModelConfig, rot_dim: int) -> tuple[torch.Tensor, float]:
    rope = config.rope_parameters
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        base = float(rope["rope_theta"])
        exponents = torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim
        return 1.0 / (base**exponents), 1.0
    # Scaled variants (linear, llama3, yarn, ...): transformers knows their formulas.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config.hf_config, device=None)
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k given absolute positions; cos/sin [P, rotary_dim] cached up to max_positions."""

    # Whether the fused Triton norm + RoPE kernel may apply it (``engine.transforms.fusion``): it reads one
    # position per token from these tables.
    fusable = True

    def __init__(self, config: ModelConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.config, self.head_dim, self.max_positions = config, head_dim, max_positions
        self.rotary_dim = rotary_dim(config, head_dim)
        self.register_buffer("cos_cache", torch.empty(max_positions, self.rotary_dim), persistent=False)
        self.register_buffer("sin_cache", torch.empty(max_positions, self.rotary_dim), persistent=False)
        if self.cos_cache.device.type != "meta":
            self.build_cache()

    @torch.no_grad()
    def build_cache(self) -> None:
        """Fill the cos/sin tables in float32 (called again after a model is built on the meta device)."""
        inv_freq, scaling = _inv_freq(self.config, self.rotary_dim)
        positions = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [P, r/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, r]
        self.cos_cache = (emb.cos() * scaling).to(self.cos_cache.device)
        self.sin_cache = (emb.sin() * scaling).to(self.sin_cache.device)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T]; q [T, h, d]; k [T, kvh, d]
        cos = self.cos_cache[positions].to(q.dtype)[:, None, :]  # [T, 1, r]
        sin = self.sin_cache[positions].to(q.dtype)[:, None, :]
        return self.rotate(q, k, cos, sin)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, h, d], k [T, kvh, d] rotated by cos, sin [T, 1, r] (their first r dims; the rest pass through)."""
        if self.rotary_dim == self.head_dim:
            return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin
        r = self.rotary_dim
        q = torch.cat([q[..., :r] * cos + self._rotate_half(q[..., :r]) * sin, q[..., r:]], dim=-1)
        k = torch.cat([k[..., :r] * cos + self._rotate_half(k[..., :r]) * sin, k[..., r:]], dim=-1)
        return q, k
