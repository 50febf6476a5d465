"""Manifold-constrained hyper-connections (DeepSeek-V4): the residual is ``n`` parallel streams per token.

Before a block (attention or MLP) the streams are collapsed into its one input by learned per-token weights
("pre"); after it, its output is spread back over the streams ("post") and added to the streams mixed by a
per-token ``n x n`` matrix ("comb"), which a few Sinkhorn-Knopp iterations make (nearly) doubly stochastic so
the mixed residual keeps its scale. All three come from one linear map of the token's normalised streams.
Computed in float32, as the reference keeps these modules.
"""

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.float32_params import KeepsFloat32


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, the rms computed in float32 and applied in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(KeepsFloat32):
    """Legend: T tokens, n streams (``hc_mult``), H hidden.

    Checkpoint names (``attn_hc`` / ``ffn_hc``): ``fn`` [(2 + n) * n, n * H], ``base`` [(2 + n) * n], ``scale`` [3].
    """

    float32_params = ("fn", "base", "scale")

    def __init__(self, streams: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.n, self.sinkhorn_iters, self.hc_eps, self.norm_eps = streams, sinkhorn_iters, hc_eps, norm_eps
        width = (2 + streams) * streams
        self.fn = nn.Parameter(torch.empty(width, streams * hidden_size))
        self.base = nn.Parameter(torch.empty(width))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, H] -> post [T, n], comb [T, n, n] (float32), the block's input [T, H] (streams' dtype)."""
        n = self.n
        mixes = F.linear(unweighted_rms(streams.flatten(1).float(), self.norm_eps), self.fn.float())  # [T, (2+n)n]
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps  # [T, n]
        post = 2 * torch.sigmoid(post_w * post_s + post_b)  # [T, n]
        comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)  # [T, H]
        return post, comb, collapsed

    @staticmethod
    def merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The streams after a block: out [T, H] spread by post [T, n], plus streams [T, n, H] mixed by comb
        (``comb[j, k]`` takes input stream j into output stream k) -> [T, n, H]."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(KeepsFloat32):
    """The final collapse of the streams into one hidden state (before the model's norm).

    Checkpoint names (``model.hc_head``): ``hc_fn`` [n, n * H], ``hc_base`` [n], ``hc_scale`` [1]."""

    float32_params = ("hc_fn", "hc_base", "hc_scale")

    def __init__(self, streams: int, hidden_size: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(streams, streams * hidden_size))
        self.hc_base = nn.Parameter(torch.empty(streams))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [T, n, H] -> [T, H]."""
        mixes = F.linear(unweighted_rms(streams.flatten(1).float(), self.norm_eps), self.hc_fn.float())  # [T, n]
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
