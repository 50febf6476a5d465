"""The CPU KV caches: zeros that take memory only where written, and a block pool that makes its blocks on
first use; both checked against what they replace (``torch.zeros``; an eager pool written out here)."""

import os
import random
from collections import OrderedDict

import torch

from engine.core.block_pool import BlockPool
from engine.worker.kv_memory import zeros_on_first_touch

MIB = 1 << 20


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_cache_memory_is_taken_only_where_written():
    """A 512 MiB cache costs (almost) no resident memory until written; writing a few random blocks
    takes about their size; it reads back what was written and zeros everywhere else."""
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    shape = (8192, 16, 4, 64)  # [blocks, block_size, kv_heads, head_dim] float32: 512 MiB
    before = _resident_bytes()
    cache = zeros_on_first_touch(shape, torch.float32)
    assert cache.shape == shape and cache.dtype == torch.float32
    assert _resident_bytes() - before < 16 * MIB, f"seed={seed}"
    blocks = rng.sample(range(shape[0]), 32)  # 32 blocks of 16 KiB
    values = torch.randn(len(blocks), *shape[1:], generator=torch.Generator().manual_seed(seed))
    cache[blocks] = values
    assert _resident_bytes() - before < 32 * MIB, f"seed={seed}"
    assert torch.equal(cache[blocks], values), f"seed={seed}"
    others = [b for b in rng.sample(range(shape[0]), 64) if b not in blocks]
    assert torch.count_nonzero(cache[others]) == 0, f"seed={seed}"


class _EagerPool:
    """The reference: every block made at start, all in one LRU queue in id order."""

    def __init__(self, n: int) -> None:
        self.ref = [0] * n
        self.free = OrderedDict((i, None) for i in range(n))

    def allocate(self, count: int) -> list[int]:
        taken = [self.free.popitem(last=False)[0] for _ in range(count)]
        for i in taken:
            self.ref[i] = 1
        return taken

    def release(self, ids: list[int]) -> None:
        for i in ids:
            self.ref[i] -= 1
            if self.ref[i] == 0:
                self.free[i] = None


def test_lazy_block_pool_hands_out_the_eager_pools_blocks():
    """Random allocate/release sequences: the pool that makes blocks on first use hands out the same block
    ids, in the same order, and counts the same free blocks as an eager pool with one LRU queue."""
    for seed in [random.randrange(2**31) for _ in range(20)]:
        rng = random.Random(seed)
        n = rng.randint(1, 40)
        lazy, eager = BlockPool(n, enable_caching=True), _EagerPool(n)
        held: list[list] = []
        for _ in range(200):
            if held and (rng.random() < 0.45 or lazy.num_free_blocks == 0):
                blocks = held.pop(rng.randrange(len(held)))
                lazy.release(list(reversed(blocks)))
                eager.release(list(reversed([b.block_id for b in blocks])))
            else:
                count = rng.randint(1, max(1, lazy.num_free_blocks))
                got = lazy.allocate(count)
                assert [b.block_id for b in got] == eager.allocate(count), f"seed={seed}"
                held.append(got)
            assert lazy.num_free_blocks == len(eager.free), f"seed={seed}"
        for blocks in held:
            lazy.release(blocks)
        lazy.check_all_free()
