"""Where each request's recurrent state lives for one forward: what the linear-attention layers read."""

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class StateMetadata:
    """Legend: D decode requests (flat rows [0, D), one token each), P prefill chunks.

    ``decode_slots`` [D] int64 on the device: the state slot of flat row i; ``decode_fresh`` [D] bool: that token
    is the request's first (a one-token prompt), so its state starts at zero. ``prefills``: (first flat row, end
    row, slot, fresh) per chunk, on the host; ``fresh``: the chunk starts at position 0, so its state starts at
    zero whatever its slot held (a slot is reused without being cleared, and a preempted request's state is
    recomputed from its first token, like its KV). ``prefill_chunks`` [P, 4] int64 on the device: the same rows
    (first row, end row, slot, fresh as 0/1), for kernels that read them there (``engine.kernels.delta_rule``).
    """

    num_decodes: int
    decode_slots: torch.Tensor
    decode_fresh: torch.Tensor
    prefills: tuple[tuple[int, int, int, bool], ...]
    prefill_chunks: torch.Tensor | None = None


def build_state_metadata(parts: list[tuple[int, int, int, int]], device: torch.device) -> StateMetadata:
    """``parts``: (first flat row, end row, state slot, start position) of each scheduled request, any order; the
    decodes (one row each) must be the flat rows [0, D), as the batch builders order them."""
    decodes = sorted((row, slot, start) for row, end, slot, start in parts if end - row == 1)
    assert [row for row, _, _ in decodes] == list(range(len(decodes))), "decode rows must lead the flat batch"
    prefills = tuple((row, end, slot, start == 0) for row, end, slot, start in sorted(parts) if end - row > 1)
    slots = torch.tensor([slot for _, slot, _ in decodes], dtype=torch.int64).to(device, non_blocking=True)
    fresh = torch.tensor([start == 0 for _, _, start in decodes], dtype=torch.bool).to(device, non_blocking=True)
    chunks = torch.tensor([[row, end, slot, int(fresh_)] for row, end, slot, fresh_ in prefills],
                          dtype=torch.int64).view(-1, 4).to(device, non_blocking=True)  # [P, 4]
    return StateMetadata(len(decodes), slots, fresh, prefills, chunks)
