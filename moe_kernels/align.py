"""Group token slots by expert for the grouped GEMMs, on the device and without a host sync.

Legend: T tokens, k top-k, S = T*k slots (slot s is token s // k, choice s % k),
E experts, P padded slot count, B blocks of BLOCK_M rows.

A block of BLOCK_M rows belongs to exactly one expert, so a Triton program
loads one expert's weight tiles for all of its rows. The number of slots per
expert is only known on the device; reading it back would stall the CPU on
every MoE layer, so buffers are sized for the worst case and the kernels read
the real padded length (``num_padded``) from device memory and skip the rest.
"""

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SlotBlocks:
    """How the grouped-GEMM programs map onto token slots.

    sorted_slot_ids: [P] int32, slot index per padded row, grouped by expert;
        padding rows hold the sentinel S (= T*k), which kernels mask out.
        Unused when ``sorted`` is False.
    block_expert_ids: [B] int32, the expert of each block of ``block_m`` rows;
        -1 for blocks past ``num_padded``. When ``sorted`` is False this is the
        flat topk_ids: one block per slot, its expert.
    num_padded: [1] int32 on the device, rows actually used (a multiple of
        ``block_m``). Unused when ``sorted`` is False.
    num_blocks: B, the grid's row-block count (a host int from shapes only).
    block_m: rows per block.
    sorted: False for the no-alignment path (one slot per block).
    """

    sorted_slot_ids: torch.Tensor
    block_expert_ids: torch.Tensor
    num_padded: torch.Tensor
    num_blocks: int
    block_m: int
    sorted: bool


def max_padded_slots(num_slots: int, num_experts: int, block_m: int) -> int:
    """Worst-case padded length: every expert that gets a slot wastes at most block_m - 1 rows.

    At most min(E, S) experts can be non-empty, which keeps decode-sized
    batches from allocating E * (block_m - 1) rows they can never use. The
    real padded length is a multiple of block_m, so rounding the bound down
    to one is still a bound.
    """
    worst = num_slots + min(num_experts, num_slots) * (block_m - 1)
    return worst // block_m * block_m


def align_slots(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> SlotBlocks:
    """Sort the [T, k] slots by expert and pad each expert's run to a multiple of ``block_m``.

    Only torch ops on ``topk_ids``' device, with shapes known on the host: no
    ``.item()``, no ``.tolist()``, no ``bincount`` (which syncs on CUDA to find
    its output length).
    """
    device = topk_ids.device
    flat_ids = topk_ids.reshape(-1).to(torch.int64)  # [S]
    num_slots = flat_ids.numel()
    padded_len = max_padded_slots(num_slots, num_experts, block_m)

    # Stable: slots of one expert stay in token order, so results do not depend on sort internals.
    sorted_experts, slot_order = torch.sort(flat_ids, stable=True)  # [S], [S]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)  # [E]
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
    padded_counts = (counts + (block_m - 1)) // block_m * block_m  # [E]
    padded_ends = torch.cumsum(padded_counts, 0)  # [E]
    # Where each expert's run starts after padding, minus where it starts unpadded.
    shift = (padded_ends - padded_counts) - (torch.cumsum(counts, 0) - counts)  # [E]
    rows = torch.arange(num_slots, device=device) + shift.index_select(0, sorted_experts)  # [S]

    sorted_slot_ids = torch.full((padded_len,), num_slots, dtype=torch.int32, device=device)  # [P]
    sorted_slot_ids.scatter_(0, rows, slot_order.to(torch.int32))

    num_blocks = padded_len // block_m
    block_starts = torch.arange(num_blocks, device=device) * block_m  # [B]
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)  # [B], E past the end
    block_expert_ids = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)  # [B]
    num_padded = padded_ends[-1:].to(torch.int32)  # [1]
    return SlotBlocks(sorted_slot_ids, block_expert_ids, num_padded, num_blocks, block_m, sorted=True)


def unsorted_slots(topk_ids: torch.Tensor, block_m: int) -> SlotBlocks:
    """One block per slot, no sorting: for a handful of tokens the alignment's
    launches cost more than reading an expert twice.

    For T=1 it reads exactly the same weights as the sorted path (a token's k
    experts are distinct). The kernels use only row 0 of each block.
    """
    ids = flat_ids(topk_ids)  # [S]
    empty = ids[:0]
    return SlotBlocks(empty, ids, empty, ids.numel(), block_m, sorted=False)


def flat_ids(topk_ids: torch.Tensor) -> torch.Tensor:
    """[T, k] -> [S] int32 (a view when the ids already are int32, as route() returns them)."""
    ids = topk_ids.reshape(-1)
    return ids if ids.dtype == torch.int32 else ids.to(torch.int32)
