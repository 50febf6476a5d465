"""RMSNorm with the Hugging Face numerics (normalize in float32, scale in the input dtype)."""

import torch
from torch import nn

from engine.kernels.elementwise import rms_norm


class RMSNorm(nn.Module):
    """``forward(x)`` -> norm(x); ``forward(x, residual)`` -> (norm(x + residual), x + residual).

    The second form lets a decoder layer hand its output and the running
    residual to the next norm, which adds and normalizes in one pass when
    ``fused`` (set by ``engine.transforms.fusion``) selects the Triton kernel.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.fused = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.fused and x.dim() == 2:
            return rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual  # in the model dtype, as transformers adds residuals
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
