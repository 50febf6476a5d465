"""The floor of a step's time: bytes it must read over memory bandwidth, FLOPs over peak compute.

Legend: T tokens in the step, N rows that reach the LM head, E experts, k top-k.

Only what a perfect implementation cannot avoid is counted: every dense
weight once; of the routed experts, only those that at least one token of
the step was routed to (measured with ``ExpertHits``); one embedding row per
token; the K/V the attention must read and write. FLOPs are 2 per
multiply-add of every weight a token meets (its k experts, not all E) plus
attention's q.k and p.v products.
"""

from dataclasses import dataclass

import torch

from engine.layers.moe import SparseMoeBlock
from engine.models import MoECausalLM


@dataclass(frozen=True, slots=True)
class ModelCosts:
    """Sizes of one model in bytes and parameters, as the floors need them."""

    dense_bytes: int  # weights every forward reads whatever the batch (attention, norms, routers, shared experts)
    lm_head_bytes: int
    lm_head_params: int
    embed_row_bytes: int  # one token's embedding row
    expert_bytes: int  # one routed expert's w13 and w2 slices
    dense_params: int  # multiplied by every token (excludes embedding and LM head)
    routed_params_per_token: int  # k experts' parameters over all MoE layers
    kv_bytes_per_token: int  # K and V of one token over all layers
    attn_flops_per_pair: int  # q.k and p.v FLOPs of one (query, key) pair over all layers and heads


def model_costs(model: MoECausalLM) -> ModelCosts:
    c = model.config
    element = next(model.parameters()).element_size()
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    # Expert parameters with their scales when 8-bit (bytes at their own dtypes; FLOPs from the weights alone).
    routed = sum(p.numel() for b in blocks for p in b.experts.parameters())
    embed = model.model.embed_tokens.weight
    lm_head = model.lm_head.weight
    total = sum(p.numel() for p in model.parameters())  # a tied LM head is counted once here
    tied = lm_head is embed
    dense = total - routed - embed.numel() - (0 if tied else lm_head.numel())
    per_expert = [(b.experts.w13.numel() + b.experts.w2.numel()) // b.experts.w13.shape[0] for b in blocks]
    expert_bytes = [sum(p.numel() * p.element_size() for p in b.experts.parameters()) // b.experts.w13.shape[0]
                    for b in blocks]
    return ModelCosts(
        dense_bytes=dense * element,
        lm_head_bytes=lm_head.numel() * element,
        lm_head_params=lm_head.numel(),
        embed_row_bytes=c.hidden_size * element,
        expert_bytes=expert_bytes[0] if expert_bytes else 0,
        dense_params=dense,
        routed_params_per_token=sum(b.top_k * n for b, n in zip(blocks, per_expert)),
        kv_bytes_per_token=2 * c.num_layers * c.num_kv_heads * c.head_dim * element,
        attn_flops_per_pair=4 * c.num_layers * c.num_heads * c.head_dim,
    )


@dataclass(frozen=True, slots=True)
class Floor:
    bytes: int
    flops: int
    seconds: float  # max(bytes / bandwidth, flops / peak)
    bound: str  # "memory" or "compute"


def step_floor(costs: ModelCosts, *, num_tokens: int, num_logits: int, experts_hit: int, kv_tokens_read: int,
               attn_pairs: int, bandwidth_bytes_s: float, peak_flops_s: float) -> Floor:
    """Floor of one forward: ``experts_hit`` summed over MoE layers, ``kv_tokens_read`` summed over queries' contexts
    (each request's cached tokens once), ``attn_pairs`` visible (query, key) pairs."""
    moved = (
        costs.dense_bytes + costs.lm_head_bytes + num_tokens * costs.embed_row_bytes + experts_hit * costs.expert_bytes
        + (kv_tokens_read + num_tokens) * costs.kv_bytes_per_token  # reads, then this step's own K/V written
    )
    flops = (
        2 * num_tokens * (costs.dense_params + costs.routed_params_per_token) + 2 * num_logits * costs.lm_head_params
        + attn_pairs * costs.attn_flops_per_pair
    )
    memory_s, compute_s = moved / bandwidth_bytes_s, flops / peak_flops_s
    return Floor(moved, flops, max(memory_s, compute_s), "memory" if memory_s >= compute_s else "compute")


class ExpertHits:
    """Counts distinct experts routed to per MoE layer, per forward, with hooks on the routers.

    Use around eager forwards only (a CUDA graph replay runs no hooks); reading the counts syncs the device.
    """

    def __init__(self, model: MoECausalLM) -> None:
        self.blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        self.hits: list[torch.Tensor] = []  # one 0-d tensor per layer call
        self._handles = []

    def __enter__(self) -> "ExpertHits":
        for block in self.blocks:
            self._handles.append(block.gate.register_forward_hook(self._hook(block.top_k)))
        return self

    def _hook(self, top_k: int):
        def hook(module, inputs, router_logits):  # router_logits [T, E]
            ids = router_logits.float().topk(top_k, dim=-1).indices  # [T, k]; routing picks by the same order
            hit = torch.zeros(router_logits.shape[1], dtype=torch.bool, device=ids.device)
            self.hits.append(hit.index_fill_(0, ids.flatten(), True).sum())
        return hook

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def total(self) -> int:
        """Experts hit summed over every recorded layer call."""
        return int(torch.stack(self.hits).sum()) if self.hits else 0
