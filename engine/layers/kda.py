"""Kimi Delta Attention (Kimi-Linear's linear layers): the gated delta rule with a decay per key channel.

Legend: T scheduled tokens, D decode requests, H hidden, h heads, d head dim (keys and values alike), C conv
channels (3 h d), K conv kernel, S state slots. Under tensor parallelism h and C are this rank's: each rank holds
a run of heads, the q/k/v, decay and gate projections' rows of those heads, their convolution channels, their
decay rates and their states; the low-rank inputs (``f_a_proj``, ``g_a_proj``) and ``o_norm`` are whole on every
rank, and ``o_proj`` is summed over the ranks.

Per token: project to q, k, v (each ``h d``), run each through its own causal depthwise convolution of K taps
(SiLU; ``engine.layers.short_conv``, the three as one of C channels), L2-normalize q and k, then the Kimi delta
rule (``engine.layers.kda_rule``) over each request's state with a per-channel log decay
g = -exp(A_log[head]) * softplus(f_b(f_a(x)) + dt_bias) and write strength sigmoid(b(x)); RMSNorm each head's
output (float32) times sigmoid(g_b(g_a(x))), and project back. The state (the convs' last K - 1 inputs and the
rule's [h, d, d] matrix) lives in the state cache at the request's slot, carried between prefill chunks and
decode steps, as Gated DeltaNet's does (``engine.layers.gated_deltanet``).
"""

import torch
import torch.nn.functional as F
from torch import nn

from engine.device_batch.state_metadata import StateMetadata
from engine.distributed.collectives import SINGLE, TensorParallel
from engine.layers.cache_spec import StateSpec
from engine.layers.kda_rule import chunked_kda_rule, recurrent_kda_rule
from engine.layers.moe import target_device
from engine.layers.short_conv import causal_short_conv
from engine.layers.state_rules import rule_over_requests


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim (the published kernels' form: eps inside the root, then divide)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def _depthwise_conv(channels: int, kernel: int) -> nn.Conv1d:
    return nn.Conv1d(channels, channels, kernel, groups=channels, bias=False)


class KimiDeltaAttention(nn.Module):
    """Named as in the checkpoint (``self_attn.q_proj``, ``q_conv1d``, ``f_a_proj``, ``A_log``, ``o_norm``, ...)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, conv_kernel: int, rms_norm_eps: float,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        num_heads = tp.shard(num_heads, "linear_num_heads")[1]  # h: this rank's heads
        self.h, self.d, self.kernel = num_heads, head_dim, conv_kernel
        width = num_heads * head_dim
        self.channels = 3 * width  # C: q, k, v convolved side by side
        self.q_proj = nn.Linear(hidden_size, width, bias=False)
        self.k_proj = nn.Linear(hidden_size, width, bias=False)
        self.v_proj = nn.Linear(hidden_size, width, bias=False)
        self.q_conv1d = _depthwise_conv(width, conv_kernel)
        self.k_conv1d = _depthwise_conv(width, conv_kernel)
        self.v_conv1d = _depthwise_conv(width, conv_kernel)
        self.f_a_proj = nn.Linear(hidden_size, head_dim, bias=False)  # the decay's low-rank input
        self.f_b_proj = nn.Linear(head_dim, width, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(width))
        self.A_log = nn.Parameter(torch.empty(1, 1, num_heads, 1))  # the checkpoint's shape: one rate per head
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden_size, head_dim, bias=False)  # the output gate's low-rank input
        self.g_b_proj = nn.Linear(head_dim, width, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.empty(head_dim))
        self.eps = rms_norm_eps
        self.o_proj = nn.Linear(width, hidden_size, bias=False)
        # "torch" or "triton" (``engine.kernels.delta_rule``): set from the engine's attention kernels at load.
        self.rule_kernel = "torch"
        # (conv [S, C, K - 1], recurrent [S, h, d, d]); bound by the runner once the state cache is allocated.
        self.state_cache: tuple[torch.Tensor, torch.Tensor] = (torch.empty(0), torch.empty(0))

    def _apply(self, fn, recurse=True):
        # A model-wide cast (``model.to(bfloat16)``) leaves ``dt_bias`` float32, as the published checkpoints store
        # and transformers runs it: it shifts every decay's softplus input. It follows the device only.
        kept = self.dt_bias.detach().clone()
        super()._apply(fn, recurse)
        device = target_device(fn, kept)
        self.dt_bias = nn.Parameter(torch.empty_like(kept, device=device) if kept.is_meta else kept.to(device),
                                    requires_grad=False)
        return self

    def state_spec(self) -> StateSpec:
        return StateSpec((self.channels, self.kernel - 1), (self.h, self.d, self.d))

    def tp_slices(self, local_name: str, rank: int) -> tuple[slice, ...] | None:
        """This rank's part of checkpoint tensor ``self_attn.<local_name>`` (None: whole, as the low-rank inputs)."""
        width = self.h * self.d  # this rank's channels of each of q, k, v (and of the decay and gate)
        heads = slice(rank * self.h, (rank + 1) * self.h)
        channels = slice(rank * width, (rank + 1) * width)
        if local_name == "A_log":  # [1, 1, h, 1]
            return (slice(None), slice(None), heads)
        if local_name == "b_proj.weight":  # [h, H]: one write strength per head
            return (heads,)
        if local_name == "o_proj.weight":  # [H, h d]: this rank's heads' columns
            return (slice(None), channels)
        if local_name in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight",
                          "v_conv1d.weight", "f_b_proj.weight", "g_b_proj.weight", "dt_bias"):  # [h d, ...]
            return (channels,)
        return None

    def forward(self, x: torch.Tensor, states: StateMetadata) -> torch.Tensor:
        """x [T, H] -> [T, H]; reads and updates each request's state at its slot."""
        num_tokens = x.shape[0]
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [T, C]
        weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])[:, 0, :]  # [C, K]
        mixed = causal_short_conv(mixed, weight, self.state_cache[0], states)
        q, k, v = (t.reshape(num_tokens, self.h, self.d) for t in mixed.chunk(3, dim=-1))  # [T, h, d] each
        q = _l2norm(q.float()) * self.d ** -0.5
        k = _l2norm(k.float())
        decay_in = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()  # [T, h d]
        g = -self.A_log.float().view(self.h, 1).exp() * F.softplus(decay_in.view(num_tokens, self.h, self.d))
        beta = self.b_proj(x).sigmoid()  # [T, h]
        core = self._rule(q, k, v, g, beta, states).to(x.dtype)  # [T, h, d]
        gate = self.g_b_proj(self.g_a_proj(x)).view(num_tokens, self.h, self.d)
        return self.tp.all_reduce(self.o_proj(self._gated_norm(core, gate).reshape(num_tokens, self.h * self.d)))

    def _rule(self, q, k, v, g, beta, states: StateMetadata) -> torch.Tensor:
        """The Kimi delta rule over each request's tokens from its state -> [T, h, d] float32."""
        return rule_over_requests(recurrent_kda_rule, chunked_kda_rule, self.state_cache[1], q, k, v, g, beta, states,
                                  self.rule_kernel)

    def _gated_norm(self, core: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head's d values, scaled and gated by sigmoid(gate) all in float32 (the weight too)."""
        x32 = core.float()
        normed = self.o_norm.weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))
        return (normed * gate.float().sigmoid()).to(core.dtype)
