"""The order in which the block pool hands out its free blocks: which cached prefix is evicted first.

Two policies (``EngineConfig.kv_eviction_policy``, docs/decisions/priority-eviction.md):

- ``lru``: one queue, least recently freed first, cached or not.
- ``priority``: free blocks that hold no cached prefix go first; then cached ones of the least urgent priority
  class present (a class is the most urgent request's that used the block); within that class, those of the
  tenant holding the most free cached blocks of the class (its flood evicts its own blocks first), least
  recently freed first.

Both cost amortised O(log n) per operation (the classes and tenants in heaps with lazy deletion); no scan.
Plain Python, no torch.
"""

import heapq
import itertools
from collections import OrderedDict
from typing import Protocol

from engine.core.block import Block
from engine.core.config_choices import EVICTION_POLICIES


class FreeQueue(Protocol):
    """Free blocks (ref count 0) of the pool. A block's hash, tenant and priority do not change while queued."""

    def __len__(self) -> int: ...

    def push(self, block: Block) -> None: ...

    def remove(self, block: Block) -> None: ...

    def pop(self) -> Block: ...


class LruFreeQueue:
    """Least recently freed first, whatever a block holds."""

    def __init__(self) -> None:
        self._blocks: OrderedDict[int, Block] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def push(self, block: Block) -> None:
        self._blocks[block.block_id] = block

    def remove(self, block: Block) -> None:
        del self._blocks[block.block_id]

    def pop(self) -> Block:
        return self._blocks.popitem(last=False)[1]


class _Class:
    """One priority class's free cached blocks: per tenant in LRU order, and a max-heap of tenants by count.

    The heap holds (-count, seq, tenant) entries; an entry is current iff its count is the tenant's count now
    (stale ones are skipped when they surface, and the heap is rebuilt when stale ones outnumber current ones)."""

    __slots__ = ("tenants", "heap", "size")

    def __init__(self) -> None:
        self.tenants: dict[str, OrderedDict[int, Block]] = {}
        self.heap: list[tuple[int, int, str]] = []
        self.size = 0

    def note(self, tenant: str, seq: int) -> None:
        count = len(self.tenants.get(tenant, ()))
        if count:
            heapq.heappush(self.heap, (-count, seq, tenant))
        if len(self.heap) > 2 * len(self.tenants) + 16:  # too many stale entries: keep the heap small
            self.heap = [(-len(blocks), seq, t) for t, blocks in self.tenants.items()]
            heapq.heapify(self.heap)

    def largest_tenant(self) -> str:
        while True:
            negative_count, _, tenant = self.heap[0]
            if len(self.tenants.get(tenant, ())) == -negative_count:
                return tenant
            heapq.heappop(self.heap)


class PriorityFreeQueue:
    """Uncached free blocks first, then cached ones by (least urgent class, largest tenant there, LRU)."""

    def __init__(self) -> None:
        self._plain: OrderedDict[int, Block] = OrderedDict()  # no hash: nothing lost by taking them
        self._classes: dict[int, _Class] = {}
        self._class_heap: list[int] = []  # -priority of classes with blocks (lazy: emptied ones skipped)
        self._heaped: set[int] = set()  # the priorities in ``_class_heap``
        self._seq = itertools.count()
        self._cached = 0  # blocks in the classes

    def __len__(self) -> int:
        return len(self._plain) + self._cached

    def push(self, block: Block) -> None:
        if block.block_hash is None:
            self._plain[block.block_id] = block
            return
        cls = self._classes.get(block.priority)
        if cls is None:
            cls = self._classes[block.priority] = _Class()
            if block.priority not in self._heaped:
                self._heaped.add(block.priority)
                heapq.heappush(self._class_heap, -block.priority)
        cls.tenants.setdefault(block.tenant, OrderedDict())[block.block_id] = block
        cls.size += 1
        self._cached += 1
        cls.note(block.tenant, next(self._seq))

    def remove(self, block: Block) -> None:
        if block.block_hash is None:
            del self._plain[block.block_id]
            return
        cls = self._classes[block.priority]
        self._take(cls, block.priority, block.tenant, block.block_id)

    def pop(self) -> Block:
        if self._plain:
            return self._plain.popitem(last=False)[1]
        while True:
            priority = -self._class_heap[0]
            cls = self._classes.get(priority)
            if cls is not None:
                break
            heapq.heappop(self._class_heap)  # a class emptied since: its entry is stale
            self._heaped.discard(priority)
        tenant = cls.largest_tenant()
        block_id = next(iter(cls.tenants[tenant]))
        return self._take(cls, priority, tenant, block_id)

    def _take(self, cls: _Class, priority: int, tenant: str, block_id: int) -> Block:
        blocks = cls.tenants[tenant]
        block = blocks.pop(block_id)
        cls.size -= 1
        self._cached -= 1
        if not blocks:
            del cls.tenants[tenant]
        cls.note(tenant, next(self._seq))
        if not cls.size:
            del self._classes[priority]  # its heap entry is dropped when it surfaces
        return block


def make_free_queue(policy: str) -> FreeQueue:
    """The free queue of ``policy`` (one of ``EVICTION_POLICIES``)."""
    if policy == "lru":
        return LruFreeQueue()
    if policy == "priority":
        return PriorityFreeQueue()
    raise ValueError(f"kv_eviction_policy must be one of {EVICTION_POLICIES}, got {policy!r}")
