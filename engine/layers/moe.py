"""The sparse MoE block: router, routed experts via moe_kernels, optional gated shared expert."""

import torch
from torch import nn

import moe_kernels
from engine.distributed.collectives import SINGLE, TensorParallel
from engine.layers.mlp import GatedMLP


class ExpertWeights(nn.Module):
    """Packed expert weights: w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class SparseMoeBlock(nn.Module):
    """Legend: T tokens, H hidden, E experts, k top-k.

    ``shared_expert_size`` > 0 adds Qwen2-MoE's shared expert, scaled by a
    sigmoid gate per token.

    Tensor parallel: every rank routes (the router is replicated) and holds a 1/tp slice of
    each expert's intermediate size (and of the shared expert's); the routed and shared partial
    outputs are added, then summed over the ranks in one all-reduce.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        backend: str,
        shared_expert_size: int = 0,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.tp = tp
        intermediate_size = tp.shard(intermediate_size, "the expert intermediate size")[1]
        self.top_k, self.renormalize, self.backend = top_k, renormalize, backend
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # router
        self.experts = ExpertWeights(num_experts, hidden_size, intermediate_size)
        if shared_expert_size:
            self.shared_expert = GatedMLP(hidden_size, shared_expert_size, tp, reduce=False)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        else:
            self.shared_expert = None
        # [E] tokens routed to each expert since start; accumulated on the device, read only for stats.
        self.register_buffer("expert_tokens", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.routing_backend = "torch"  # engine.transforms.fusion sets "triton": routing and counting in one launch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(x)  # [T, E]
        topk_weights, topk_ids = moe_kernels.route(
            router_logits, self.top_k, renormalize=self.renormalize, expert_counts=self.expert_tokens,
            backend=self.routing_backend,
        )  # [T, k]
        out = moe_kernels.fused_moe(
            x, self.experts.w13, self.experts.w2, topk_weights, topk_ids, backend=self.backend
        )  # [T, H]
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)
