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
    # Every view starts on a 16-byte boundary (an even int64 offset). Triton specializes a kernel on
    # whether each pointer is 16-byte aligned; views at whatever offset the previous arrays' lengths
    # left would flip that from step to step, and each new combination is a fresh multi-second compile.
    sizes = [_numel(shape) for shape in shapes]
    starts, offset = [], 0
    for n in sizes:
        starts.append(offset)
        offset += n + (n & 1)
    padded = [0] * offset
    for start, n, chunk in zip(starts, sizes, _chunks(flat, sizes)):
        padded[start:start + n] = chunk
    on_cuda = device.type == "cuda"
    host = torch.tensor(padded, dtype=torch.int64, pin_memory=on_cuda)
    packed = host.to(device, non_blocking=True) if on_cuda else host
    return [packed[start:start + n].view(shape) for start, n, shape in zip(starts, sizes, shapes)]


def _numel(shape: tuple) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def _chunks(flat: list[int], sizes: list[int]):
    offset = 0
    for n in sizes:
        yield flat[offset:offset + n]
        offset += n


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small per-step tensor (sampling parameters) without a synchronous copy."""
    on_cuda = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=on_cuda).to(device, non_blocking=True)
