"""Token slots sorted by expert: the one permutation both torch paths (loop and grouped) share.

Legend: T tokens, k top-k, E experts, S = T*k slots (slot s is token s // k, choice s % k).
"""

from typing import NamedTuple

import torch


class SlotsByExpert(NamedTuple):
    """Slots in expert order (stable: within one expert, in token order)."""

    order: torch.Tensor  # [S] int64: sorted position -> slot index
    tokens: torch.Tensor  # [S] int64: sorted position -> token index (order // k)
    counts: torch.Tensor  # [E] int32: slots routed to each expert


def sort_slots_by_expert(topk_ids: torch.Tensor, num_experts: int) -> SlotsByExpert:
    """Sort the [T, k] slots of ``topk_ids`` by expert id, once per layer call.

    The sort is stable so that one expert's rows stay in token order: the rows
    each expert multiplies, and so the result, do not depend on how the batch
    is laid out around them. Counts come from ``index_add_`` rather than
    ``bincount``, which reads its output size back to the host (a sync on CUDA).
    """
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1).to(torch.int64)  # [S]
    _, order = torch.sort(flat_ids, stable=True)  # [S]
    counts = torch.zeros(num_experts, dtype=torch.int32, device=topk_ids.device)
    counts.index_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))  # [E]
    return SlotsByExpert(order, order // top_k, counts)
