"""Routed experts under LoRA: every (token, expert) pair of the step, sorted once by (expert, adapter slot). The
base matmuls run per expert over that order (grouped, as the base model's torch path does), the low-rank deltas
per (expert, slot) group (``ExpertSlots.add_delta``). The deltas act before the activation (gate/up) and on the
down projection, so they cannot be added after the experts' output.

Legend: T tokens, H hidden, I expert intermediate, E experts, S slots, k top-k, N = T*k pairs."""

import torch

from engine.lora.slots import ExpertPairs, ExpertSlots, LoraBatch
from moe_kernels.activation import ExpertActivation, gated_activation_
from moe_kernels.grouped_backend import grouped_mm_supported
from moe_kernels.torch_backend import CPU_GROUPED_MAX_BYTES


def _grouped_base(xs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """The base matmuls as two grouped matmuls where they run and, on the CPU, where the [N, 2I] and [N, H]
    buffers stay small (``CPU_GROUPED_MAX_BYTES``: the same rule as the base model's torch path)."""
    if not grouped_mm_supported(xs, w13, w2):
        return False
    widest = max(w13.shape[1], w13.shape[2])
    return xs.device.type != "cpu" or xs.shape[0] * widest * xs.element_size() <= CPU_GROUPED_MAX_BYTES


def lora_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, batch: LoraBatch,
                 w13: torch.Tensor, w2: torch.Tensor, w13_slots: ExpertSlots, w2_slots: ExpertSlots,
                 activation: ExpertActivation, w13_bias: torch.Tensor | None = None,
                 w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H], topk_weights/topk_ids [T, k], ``batch``: the step's slots (its ``slot_ids`` [T]), w13 [E, 2I, H],
    w2 [E, H, I] (unquantized) -> [T, H], the weighted sum of each token's experts with its adapter's deltas
    (none for base-model tokens)."""
    num_tokens, top_k = topk_ids.shape
    pairs = ExpertPairs.sort(topk_ids, batch, w13.shape[0], w13_slots.num_slots)
    xs = x.index_select(0, pairs.order // top_k)  # [N, H], pairs in (expert, slot) order
    grouped = _grouped_base(xs, w13, w2)
    if grouped:
        gate_up = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=pairs.expert_ends)  # [N, 2I]
    else:  # per expert, over its run of the sorted pairs (group sizes read back, as the base model's loop does)
        runs = []
        start = 0
        for e, end in enumerate(pairs.expert_ends.tolist()):
            if end > start:
                runs.append((e, slice(start, end)))
            start = end
        gate_up = xs.new_empty(xs.shape[0], w13.shape[1])  # [N, 2I]
        for e, rows in runs:
            torch.matmul(xs[rows], w13[e].T, out=gate_up[rows])
    if w13_bias is not None:
        gate_up += w13_bias.to(gate_up.dtype).index_select(0, pairs.experts)
    w13_slots.add_delta(xs, pairs, gate_up)
    hidden = gated_activation_(gate_up, activation)  # [N, I], a view of gate_up's gate half
    if grouped:
        down = torch._grouped_mm(hidden, w2.transpose(-2, -1), offs=pairs.expert_ends)  # [N, H]
    else:
        down = xs.new_empty(xs.shape[0], w2.shape[1])  # [N, H]
        for e, rows in runs:
            torch.matmul(hidden[rows], w2[e].T, out=down[rows])
    if w2_bias is not None:
        down += w2_bias.to(down.dtype).index_select(0, pairs.experts)
    w2_slots.add_delta(hidden, pairs, down)
    # Combine: each pair weighted (float32 at least), back to pair order, each token's k rows summed in routing order.
    acc_dtype = torch.promote_types(down.dtype, torch.float32)
    weighted = down.to(acc_dtype).mul_(topk_weights.reshape(-1).index_select(0, pairs.order).to(acc_dtype)[:, None])
    unsorted = torch.empty_like(weighted).index_copy_(0, pairs.order, weighted)  # [N, H] in pair order
    return unsorted.view(num_tokens, top_k, -1).sum(1).to(x.dtype)  # [T, H]
