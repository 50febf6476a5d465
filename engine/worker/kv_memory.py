"""CPU memory for the KV caches: zeros that cost nothing until written.

The KV caches are gigabytes allocated once and mostly untouched for a long time. ``torch.zeros``
writes every byte at start (about a second per 2 GB, all of it resident at once); an anonymous
memory mapping is zero by the kernel's guarantee and takes memory only for the pages written.
"""

import math
import mmap

import torch


def zeros_on_first_touch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros backed by an anonymous memory mapping: no work and no resident memory until
    its pages are written. The tensor keeps the mapping alive."""
    numel = math.prod(shape)
    if numel == 0:  # an empty part of a spec (torch cannot view an empty buffer)
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, max(numel * dtype.itemsize, 1))
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)
