"""Reading and writing whole blocks of the paged KV cache as bytes, whatever the layers cache.

Each attention layer holds the tensors its ``CacheSpec`` describes, each ``[num_blocks + 1, block_size,
*per_token_shape]`` ((K, V) for standard attention, one latent tensor for MLA). A block's bytes are the
concatenation of its rows in every layer's tensors, in order: both engines of a pair run the same model and
block size, so they lay blocks out the same way. Tensors shared by several layers (the two cache groups of a
model with sliding-window layers) count once: a block is then one group's block, whichever the pool gave it to.
"""

import math

import torch


class BlockLayout:
    """Gathers blocks out of and scatters them into a model's KV caches."""

    def __init__(self, caches: list[tuple[torch.Tensor, ...]]) -> None:
        # Once each: with two cache groups the i-th full and the i-th sliding layer share their tensors
        # (``engine.worker.cache_groups``), and a block of them belongs to whichever group holds its id.
        seen: set[int] = set()
        self.tensors = [t for layer in caches for t in layer if id(t) not in seen and not seen.add(id(t))]
        # Bytes of one block in each tensor: block_size * prod(per-token shape) * element size.
        self.sizes = [math.prod(t.shape[1:]) * t.element_size() for t in self.tensors]
        self.bytes_per_block = sum(self.sizes)
        self.device = self.tensors[0].device

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the blocks' contents: uint8 [len(block_ids), bytes_per_block]."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        n = len(block_ids)
        # Each tensor's rows [n, block_size, *shape] viewed as bytes [n, its bytes per block].
        parts = [t.index_select(0, ids).reshape(n, -1).view(torch.uint8) for t in self.tensors]
        return torch.cat(parts, dim=1)

    def scatter(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write ``data`` (uint8 [len(block_ids), bytes_per_block], from ``gather``) into the blocks."""
        assert data.shape == (len(block_ids), self.bytes_per_block), data.shape
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        data = data.to(self.device)
        start = 0
        for t, size in zip(self.tensors, self.sizes):
            # A fresh buffer, not .contiguous(): a one-block slice already counts as contiguous, keeping the
            # whole row's stride and an odd byte offset, which cannot be viewed as a wider dtype.
            part = torch.empty((len(block_ids), size), dtype=torch.uint8, device=self.device)
            part.copy_(data[:, start:start + size])
            rows = part.view(t.dtype).view(len(block_ids), *t.shape[1:])
            t.index_copy_(0, ids, rows)
            start += size
