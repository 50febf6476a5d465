"""Rotary position embedding (NeoX layout: rotate the two halves of each head)."""

import torch
from torch import nn

from engine.loading.model_config import ModelConfig


def _inv_freq(config: ModelConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    rope = config.rope_parameters
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        base = float(rope["rope_theta"])
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (base**exponents), 1.0
    # Scaled variants (linear, llama3, yarn, ...): transformers knows their formulas.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config.hf_config, device=None)
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k given absolute positions; cos/sin cached up to max_positions."""

    def __init__(self, config: ModelConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.config, self.head_dim, self.max_positions = config, head_dim, max_positions
        self.register_buffer("cos_cache", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin_cache", torch.empty(max_positions, head_dim), persistent=False)
        if self.cos_cache.device.type != "meta":
            self.build_cache()

    @torch.no_grad()
    def build_cache(self) -> None:
        """Fill the cos/sin tables in float32 (called again after a model is built on the meta device)."""
        inv_freq, scaling = _inv_freq(self.config, self.head_dim)
        positions = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [P, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, d]
        self.cos_cache = (emb.cos() * scaling).to(self.cos_cache.device)
        self.sin_cache = (emb.sin() * scaling).to(self.sin_cache.device)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T]; q [T, h, d]; k [T, kvh, d]
        cos = self.cos_cache[positions].to(q.dtype)[:, None, :]  # [T, 1, d]
        sin = self.sin_cache[positions].to(q.dtype)[:, None, :]
        q = q * cos + self._rotate_half(q) * sin
        k = k * cos + self._rotate_half(k) * sin
        return q, k
