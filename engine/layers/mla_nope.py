"""Multi-head latent attention without positions (Kimi-Linear's full-attention layers).

Kimi-Linear's MLA layers rotate nothing: its linear layers carry the order of tokens, so the shared
``qk_rope_head_dim`` part of each key (and of each query) enters attention as projected. Everything else, the
latent cache and both attention forms, is ``MLAttention``'s.
"""

import torch

from engine.layers.mla_attention import MLAttention


class NoPositionMLAttention(MLAttention):
    """``MLAttention`` whose ``project`` leaves the rope part of queries and keys unrotated (its rotary unused)."""

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x [T, H] -> q [T, h, n + p], latent [T, r] (normalised), k_pe [T, p]; ``positions`` unused."""
        return self.project_unrotated(x)
