"""DeepSeek-V4's MoE block: routed experts whose SwiGLU clamps its inputs, beside one shared expert.

Routing scores are ``sqrt(softplus(logits))`` (``scoring_func`` "sqrtsoftplus"; "sigmoid" and "softmax" too). A
"moe" layer picks the top-k experts by score plus a correction bias; a "hash_moe" layer (the first layers of the
published models) takes them from a fixed token-id -> experts table (``tid2eid``), so it needs each token's id.
Either way the chosen experts' scores, renormalised to sum to 1 and times ``routed_scaling_factor``, weight their
outputs. Each SwiGLU clamps its gate from above and its up projection on both sides at ``swiglu_limit``.

A plain torch loop over the experts that tokens chose (exact, not fast): the fused MoE kernels do not clamp.

Tensor parallel as DeepSeek-V3's experts (``engine.layers.moe``): every rank routes (the router is whole) and
holds a 1/tp slice of every expert's and the shared expert's intermediate size (the loader cuts the gate and up
rows and the down columns); the clamps are elementwise, so each slice's partial output is exact and one
all-reduce of the routed plus shared sum gives the layer's output.
"""

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.collectives import SINGLE, TensorParallel
from engine.layers.float32_params import KeepsFloat32

_SCORES = {
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda x: torch.softmax(x, dim=-1),
}


def clamped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """gate_up [T, 2I] (gate rows first) -> silu(min(gate, limit)) * clamp(up, -limit, limit) [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class ClampedMLP(nn.Module):
    """The shared expert: ``gate_up_proj`` (packed from the checkpoint's gate_proj / up_proj), ``down_proj``."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_up_proj(x), self.limit))


class ClampedExperts(nn.Module):
    """``w13`` [E, 2I, H] (gate rows, then up), ``w2`` [E, H, I]: transformers' ``gate_up_proj`` / ``down_proj``."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], experts [T, k] int64, weights [T, k] -> sum_k weights * expert(x) [T, H], expert by expert."""
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():
            token, slot = torch.where(experts == e)
            h = clamped_swiglu(F.linear(x[token], self.w13[e]), self.limit)
            out.index_add_(0, token, (F.linear(h, self.w2[e]) * weights[token, slot, None]).to(out.dtype))
        return out


class Router(KeepsFloat32):
    """``weight`` [E, H]; ``e_score_correction_bias`` [E] (learned top-k only, float32); ``tid2eid`` [V, k] (hash
    only)."""

    float32_params = ("e_score_correction_bias",)

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, scoring: str, scaling: float,
                 vocab_size: int | None) -> None:
        super().__init__()
        if scoring not in _SCORES:
            raise ValueError(f"scoring_func {scoring!r} is not supported (one of {sorted(_SCORES)})")
        self.top_k, self.score, self.scaling = top_k, _SCORES[scoring], scaling
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        if vocab_size is None:
            self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32))
            self.tid2eid = None
        else:  # an integer table: loaded, never trained or cast
            self.tid2eid = nn.Parameter(torch.empty(vocab_size, top_k, dtype=torch.int64), requires_grad=False)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H], input_ids [T] -> experts [T, k] int64, weights [T, k]."""
        scores = self.score(F.linear(x, self.weight))  # [T, E]
        if self.tid2eid is None:
            experts = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        else:
            experts = self.tid2eid[input_ids].long()
        weights = scores.gather(1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * self.scaling


class ClampedMoeBlock(nn.Module):
    """gate (``Router``), experts (``ClampedExperts``), shared_experts (``ClampedMLP``)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 shared_size: int, limit: float, scoring: str, scaling: float, hash_vocab: int | None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        intermediate_size = tp.shard(intermediate_size, "the expert intermediate size")[1]
        shared_size = tp.shard(shared_size, "the shared expert's intermediate size")[1]
        self.gate = Router(hidden_size, num_experts, top_k, scoring, scaling, hash_vocab)
        self.experts = ClampedExperts(num_experts, hidden_size, intermediate_size, limit)
        self.shared_experts = ClampedMLP(hidden_size, shared_size, limit)
        self.first_expert = 0  # every expert is held here (no expert parallelism)
        # Tokens routed to each expert so far (the load the engine reports, as for ``SparseMoeBlock``).
        self.register_buffer("expert_tokens", torch.zeros(num_experts, dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], input_ids [T] -> [T, H]."""
        experts, weights = self.gate(x, input_ids)
        flat = experts.flatten()  # [T k]: counted without a host sync (bincount's size depends on the data)
        self.expert_tokens.scatter_add_(0, flat, torch.ones_like(flat))
        return self.tp.all_reduce(self.experts(x, experts, weights) + self.shared_experts(x))
