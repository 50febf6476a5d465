"""Routed experts under LoRA: every (token, expert) pair of the step, sorted once by (expert, adapter slot). The
base matmuls run per expert over that order (grouped, as the base model's torch path does), the low-rank deltas
per (expert, slot) group: all groups at once (``ExpertSlots.add_delta``), or on the CPU at prefill sizes one
expert at a time with the base matmuls (``ExpertSlots.add_expert_delta``). The deltas act before the activation
(gate/up) and on the down projection, so they cannot be added after the experts' output.

Legend: T tokens, H hidden, I expert intermediate, E experts, S slots, k top-k, N = T*k pairs."""

import torch

from engine.lora.slots import ExpertPairs, ExpertSlots, LoraBatch
from moe_kernels.activation import ExpertActivation, gated_activation_
from moe_kernels.grouped_backend import grouped_mm_supported
from moe_kernels.torch_backend import CPU_GROUPED_MAX_BYTES


def _whole_batch(x: torch.Tensor, num_pairs: int, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the step's pairs go through the experts all at once (off the CPU always; on the CPU where the
    base model's torch path takes its grouped matmuls: decode sizes) rather than expert by expert (the CPU at
    prefill sizes, where whole-batch [N, 2I] and [N, H] buffers cost page faults: ``CPU_GROUPED_MAX_BYTES``)."""
    if x.device.type != "cpu":
        return True
    widest = max(w13.shape[1], w13.shape[2])
    return grouped_mm_supported(x, w13, w2) and num_pairs * widest * x.element_size() <= CPU_GROUPED_MAX_BYTES


def lora_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, batch: LoraBatch,
                 w13: torch.Tensor, w2: torch.Tensor, w13_slots: ExpertSlots, w2_slots: ExpertSlots,
                 activation: ExpertActivation, w13_bias: torch.Tensor | None = None,
                 w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H], topk_weights/topk_ids [T, k], ``batch``: the step's slots (its ``slot_ids`` [T]), w13 [E, 2I, H],
    w2 [E, H, I] (unquantized) -> [T, H], the weighted sum of each token's experts with its adapter's deltas
    (none for base-model tokens)."""
    num_tokens, top_k = topk_ids.shape
    if not _whole_batch(x, topk_ids.numel(), w13, w2):
        return _expert_by_expert(x, topk_weights, topk_ids, batch, w13, w2, w13_slots, w2_slots, activation,
                                 w13_bias, w2_bias)
    pairs = ExpertPairs.sort(topk_ids, batch, w13.shape[0], w13_slots.num_slots)
    xs = x.index_select(0, pairs.order // top_k)  # [N, H], pairs in (expert, slot) order
    grouped = grouped_mm_supported(xs, w13, w2)
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


def _expert_by_expert(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, batch: LoraBatch,
                      w13: torch.Tensor, w2: torch.Tensor, w13_slots: ExpertSlots, w2_slots: ExpertSlots,
                      activation: ExpertActivation, w13_bias: torch.Tensor | None,
                      w2_bias: torch.Tensor | None) -> torch.Tensor:
    """``lora_experts`` one expert at a time, as the base model's CPU loop runs prefill-sized batches: per expert,
    its pairs (base-model ones first, then adapter by adapter) through its matmuls and its adapters' deltas, in
    buffers of that expert's size. Group sizes are read on the host (the CPU's own memory)."""
    num_tokens, top_k = topk_ids.shape
    num_experts, num_slots = w13.shape[0], w13_slots.num_slots
    slots = batch.slot_ids.to(torch.int64).repeat_interleave(top_k)  # [N]
    key, order = torch.sort(topk_ids.reshape(-1).to(torch.int64) * num_slots + slots, stable=True)
    counts = torch.bincount(key, minlength=num_experts * num_slots).view(num_experts, num_slots).tolist()
    tokens = order // top_k  # [N] token of each sorted pair
    acc_dtype = torch.promote_types(x.dtype, torch.float32)
    weights = topk_weights.reshape(-1).index_select(0, order).to(acc_dtype)  # [N]
    out = torch.zeros(num_tokens, x.shape[1], dtype=acc_dtype, device=x.device)  # [T, H]
    start = 0
    for e, per_slot in enumerate(counts):
        num_rows, base = sum(per_slot), per_slot[0]  # this expert's pairs; the base-model ones come first
        if num_rows == 0:
            continue
        rows = slice(start, start + num_rows)
        start += num_rows
        xe = x.index_select(0, tokens[rows])  # [n, H]
        gate_up = xe @ w13[e].T  # [n, 2I]
        if w13_bias is not None:
            gate_up += w13_bias[e].to(gate_up.dtype)
        if num_rows > base:
            w13_slots.add_expert_delta(e, xe[base:], per_slot[1:], gate_up[base:])
        hidden = gated_activation_(gate_up, activation)  # [n, I]
        down = hidden @ w2[e].T  # [n, H]
        if w2_bias is not None:
            down += w2_bias[e].to(down.dtype)
        if num_rows > base:
            w2_slots.add_expert_delta(e, hidden[base:], per_slot[1:], down[base:])
        out.index_add_(0, tokens[rows], down.to(acc_dtype).mul_(weights[rows, None]))
    return out.to(x.dtype)
