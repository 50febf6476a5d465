"""Routed experts under LoRA: the adapter tokens' (token, expert) pairs, grouped by expert for the base matmuls
and by (adapter, expert) for the low-rank deltas, which act before the activation (gate/up) and on the down
projection, so they cannot be added after the experts' output."""

import torch

from engine.lora.slots import ExpertSlots
from moe_kernels.activation import ExpertActivation, gated_activation


def lora_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, slot_ids: torch.Tensor,
                 w13: torch.Tensor, w2: torch.Tensor, w13_slots: ExpertSlots, w2_slots: ExpertSlots,
                 activation: ExpertActivation, w13_bias: torch.Tensor | None = None,
                 w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H], topk_weights/topk_ids [T, k], slot_ids [T] (each token's adapter slot), w13 [E, 2I, H],
    w2 [E, H, I] (unquantized) -> [T, H], the weighted sum of each token's experts with its adapter's deltas."""
    num_tokens, top_k = topk_ids.shape
    pair_x = x.repeat_interleave(top_k, 0)  # [N, H], N = T * k
    pair_e = topk_ids.reshape(-1)  # [N]
    pair_s = slot_ids.repeat_interleave(top_k)  # [N]
    order = torch.argsort(pair_e, stable=True)  # pairs grouped by expert for the base matmuls
    experts, counts = torch.unique_consecutive(pair_e[order], return_counts=True)
    groups = list(zip(experts.tolist(), order.split(counts.tolist())))
    gate_up = x.new_empty(pair_x.shape[0], w13.shape[1])  # [N, 2I]
    for e, rows in groups:
        gate_up[rows] = pair_x[rows] @ w13[e].T
    if w13_bias is not None:
        gate_up += w13_bias[pair_e]
    w13_slots.add_delta(pair_x, pair_e, pair_s, gate_up)
    hidden = gated_activation(gate_up, activation)  # [N, I]
    down = x.new_empty(pair_x.shape[0], w2.shape[1])  # [N, H]
    for e, rows in groups:
        down[rows] = hidden[rows] @ w2[e].T
    if w2_bias is not None:
        down += w2_bias[pair_e]
    w2_slots.add_delta(hidden, pair_e, pair_s, down)
    return (down.view(num_tokens, top_k, -1) * topk_weights.unsqueeze(-1).to(down.dtype)).sum(1).to(x.dtype)
