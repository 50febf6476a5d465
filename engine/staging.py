"""Per-step host-to-device metadata transfer: one pinned buffer, one non-blocking copy.

A ``torch.tensor(list, device="cuda")`` is a synchronous copy: the host waits
for the GPU to drain before the step's metadata is even on its way. Packing
every int array of a step into one pinned host tensor and copying it with
``non_blocking=True`` lets the host run ahead and build the next launch while
the GPU still works. Pinned blocks come from torch's caching host allocator,
which records the copy's stream and does not hand a block out again until the
copy has finished, so a buffer is never overwritten while in flight.
"""

from collections.abc import Sequence

import torch


def _flatten(arrays: Sequence[Sequence[int] | Sequence[Sequence[int]]]) -> tuple[list[int], list[tuple]]:
    flat: list[int] = []
    shapes: list[tuple] = []
    for arr in arrays:
        if arr and isinstance(arr[0], (list, tuple)):
            width = len(arr[0])
            for row in arr:
                assert len(row) == width, "2-D arrays are padded to one width before staging"
                flat.extend(row)
            shapes.append((len(arr), width))
        else:
            flat.extend(arr)
            shapes.append((len(arr),))
    return flat, shapes


def stage_int64(arrays: Sequence[Sequence[int] | Sequence[Sequence[int]]], device: torch.device) -> list[torch.Tensor]:
    """Int arrays (1-D lists, or 2-D lists of equal-length rows) -> int64 tensors on ``device``.

    One host tensor, one copy; the results are views of one device buffer, in input order.
    An empty 2-D array comes back with shape [0].
    """
    flat, shapes = _flatten(arrays)
    on_cuda = device.type == "cuda"
    host = torch.tensor(flat, dtype=torch.int64, pin_memory=on_cuda)
    packed = host.to(device, non_blocking=True) if on_cuda else host
    views, offset = [], 0
    for shape in shapes:
        n = 1
        for dim in shape:
            n *= dim
        views.append(packed[offset:offset + n].view(shape))
        offset += n
    return views


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small per-step tensor (sampling parameters) without a synchronous copy."""
    on_cuda = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=on_cuda).to(device, non_blocking=True)
