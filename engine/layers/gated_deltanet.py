"""Gated DeltaNet (Qwen3-Next, Qwen3.5): a linear-attention layer with a fixed-size state per request.

Legend: T scheduled tokens, D decode requests, H hidden, hk key heads, h value heads (r = h / hk per key head),
dk key dim, dv value dim, C conv channels (2 hk dk + h dv), K conv kernel, S state slots. Under tensor
parallelism hk, h and C are this rank's: each rank holds a run of key heads with their value heads, the
projections' and the convolution's channels of those heads, and its heads' states; ``out_proj`` is summed
over the ranks.

Per token: project to q, k, v (and the output gate z, the write strength b, the decay input a), run q, k, v
through a causal depthwise convolution of K taps (SiLU), L2-normalize q and k, then the gated delta rule
(``engine.layers.delta_rule``) over each request's state, RMSNorm each head's output gated by SiLU(z), and
project back. The state (the conv's last K - 1 inputs and the rule's [h, dk, dv] matrix) lives in the state
cache at the request's slot (``StateMetadata``), carried between prefill chunks and decode steps.
"""

import torch
import torch.nn.functional as F
from torch import nn

from engine.device_batch.state_metadata import StateMetadata
from engine.distributed.collectives import SINGLE, TensorParallel
from engine.layers.cache_spec import StateSpec
from engine.layers.rank_slices import RowRuns
from engine.layers.delta_rule import chunked_delta_rule, recurrent_delta_rule
from engine.layers.short_conv import causal_short_conv
from engine.layers.state_rules import rule_over_requests

def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim (the published models' normalisation, eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


# How checkpoints lay out the input projections: Qwen3-Next packs q, k, v, z per key head (``in_proj_qkvz``) and
# b, a likewise (``in_proj_ba``); Qwen3.5 keeps q, k, v contiguous (``in_proj_qkv``) and z, b, a apart.
LAYOUTS = ("per_key_head", "split")


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden_size: int, num_key_heads: int, num_value_heads: int, key_dim: int, value_dim: int,
                 conv_kernel: int, rms_norm_eps: float, layout: str, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        assert layout in LAYOUTS, layout
        if num_value_heads % num_key_heads:
            raise ValueError(f"linear_num_value_heads ({num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({num_key_heads})")
        self.tp = tp
        num_key_heads = tp.shard(num_key_heads, "linear_num_key_heads")[1]
        num_value_heads //= tp.size
        self.layout = layout
        self.hk, self.h, self.dk, self.dv = num_key_heads, num_value_heads, key_dim, value_dim
        self.key_size, self.value_size = num_key_heads * key_dim, num_value_heads * value_dim
        self.channels = 2 * self.key_size + self.value_size  # C
        self.kernel = conv_kernel
        if layout == "per_key_head":
            self.in_proj_qkvz = nn.Linear(hidden_size, self.channels + self.value_size, bias=False)
            self.in_proj_ba = nn.Linear(hidden_size, 2 * num_value_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden_size, self.channels, bias=False)
            self.in_proj_z = nn.Linear(hidden_size, self.value_size, bias=False)
            self.in_proj_b = nn.Linear(hidden_size, num_value_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden_size, num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(self.channels, self.channels, conv_kernel, groups=self.channels, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(num_value_heads))
        self.A_log = nn.Parameter(torch.empty(num_value_heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(value_dim))
        self.eps = rms_norm_eps
        self.out_proj = nn.Linear(self.value_size, hidden_size, bias=False)
        # "torch" or "triton" (``engine.kernels.delta_rule``): set from the engine's attention kernels at load.
        self.rule_kernel = "torch"
        # (conv [S, C, K - 1], recurrent [S, h, dk, dv]); bound by the runner once the state cache is allocated.
        self.state_cache: tuple[torch.Tensor, torch.Tensor] = (torch.empty(0), torch.empty(0))

    def state_spec(self) -> StateSpec:
        return StateSpec((self.channels, self.kernel - 1), (self.h, self.dk, self.dv))

    def tp_slices(self, local_name: str, rank: int) -> tuple[slice, ...] | RowRuns | None:
        """This rank's part of checkpoint tensor ``linear_attn.<local_name>`` (None: whole, as the norm)."""

        def run(per_rank: int, base: int = 0) -> tuple[slice, ...]:
            return (slice(base + rank * per_rank, base + (rank + 1) * per_rank),)

        if local_name in ("in_proj_qkv.weight", "conv1d.weight"):  # [q | k | v] channels: this rank's run of each
            key_rows = self.key_size * self.tp.size  # every rank's q (then k) channels
            return RowRuns([run(self.key_size), run(self.key_size, key_rows), run(self.value_size, 2 * key_rows)])
        r = self.h // self.hk
        per_rank_rows = {
            "in_proj_qkvz.weight": self.hk * (2 * self.dk + 2 * r * self.dv),  # packed per key head
            "in_proj_ba.weight": self.hk * 2 * r,
            "in_proj_z.weight": self.value_size,
            "in_proj_b.weight": self.h, "in_proj_a.weight": self.h, "dt_bias": self.h, "A_log": self.h,
        }
        if local_name in per_rank_rows:
            return run(per_rank_rows[local_name])
        if local_name == "out_proj.weight":  # [H, h dv]: this rank's value heads' columns
            return (slice(None), run(self.value_size)[0])
        return None

    def forward(self, x: torch.Tensor, states: StateMetadata) -> torch.Tensor:
        """x [T, H] -> [T, H]; reads and updates each request's state at its slot."""
        mixed, z, b, a = self._project(x)  # [T, C], [T, h, dv], [T, h], [T, h]
        mixed = self._convolve(mixed, states)  # [T, C]
        q, k, v = mixed.split([self.key_size, self.key_size, self.value_size], dim=-1)
        num_tokens = x.shape[0]
        q = _l2norm(q.float().view(num_tokens, self.hk, self.dk)) * self.dk ** -0.5
        k = _l2norm(k.float().view(num_tokens, self.hk, self.dk))
        v = v.view(num_tokens, self.h, self.dv)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [T, h] log decay, <= 0
        # q, k [T, hk, dk]: value head j reads key head j // (h / hk) (``rule_over_requests``).
        core = self._delta_rule(q, k, v, g, beta, states).to(x.dtype)  # [T, h, dv]
        return self.tp.all_reduce(self.out_proj(self._gated_norm(core, z).reshape(num_tokens, self.value_size)))

    def _project(self, x: torch.Tensor):
        num_tokens = x.shape[0]
        if self.layout == "split":
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(num_tokens, self.h, self.dv), self.in_proj_b(x),
                    self.in_proj_a(x))
        r = self.h // self.hk
        per_head = self.in_proj_qkvz(x).view(num_tokens, self.hk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = per_head.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(num_tokens, self.hk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v.reshape(num_tokens, -1)], dim=-1)
        return mixed, z.reshape(num_tokens, self.h, self.dv), b.reshape(num_tokens, self.h), a.reshape(num_tokens, self.h)

    def _convolve(self, mixed: torch.Tensor, states: StateMetadata) -> torch.Tensor:
        """The causal depthwise conv with SiLU over each request's tokens, continuing from its last K - 1 inputs."""
        return causal_short_conv(mixed, self.conv1d.weight[:, 0, :], self.state_cache[0], states)  # [T, C]

    def _delta_rule(self, q, k, v, g, beta, states: StateMetadata) -> torch.Tensor:
        """The gated delta rule over each request's tokens from its state -> [T, h, dv] float32."""
        return rule_over_requests(recurrent_delta_rule, chunked_delta_rule, self.state_cache[1], q, k, v, g, beta,
                                  states, self.rule_kernel)

    def _gated_norm(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head's dv values (float32, scaled in the model dtype), times SiLU(z)."""
        x32 = core.float()
        normed = self.norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(core.dtype)
        return (normed * F.silu(z.float())).to(core.dtype)
