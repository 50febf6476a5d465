"""The host-memory tier: a slab of block-sized slots (pinned on CUDA, so copies to and from the device run
asynchronously), indexed by tier key in LRU order."""

import torch

from engine.core.lru_index import Entry, LruIndex


class HostTier:
    """``capacity_bytes // block_bytes`` slots of ``block_bytes`` each. Each entry is one block's bytes over
    every attention layer (``block_copier`` lays them out)."""

    name = "host"

    def __init__(self, capacity_bytes: int, block_bytes: int, pin_memory: bool, eviction_policy: str = "lru",
                 classes: dict[str, int] | None = None) -> None:
        """``eviction_policy`` and ``classes``: the index's (``LruIndex``)."""
        self.block_bytes = block_bytes
        num_slots = capacity_bytes // block_bytes
        self.index = LruIndex(num_slots * block_bytes, eviction_policy, classes)
        # slab [num_slots, block_bytes] uint8; torch.empty takes no resident memory until slots are written.
        self.slab = torch.empty((max(num_slots, 1), block_bytes), dtype=torch.uint8, pin_memory=pin_memory)
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self.ready: dict[int, object] = {}  # slot -> CUDA event its save recorded (absent: the bytes are there)

    @property
    def num_slots(self) -> int:
        return self.index.capacity // self.block_bytes

    def slot_of(self, key: bytes, touch: bool = True) -> int | None:
        entry = self.index.get(key, touch)
        return None if entry is None else entry.handle

    def reserve(self, key: bytes, tenant: str, share: float | None) -> tuple[int | None, list[tuple[bytes, Entry]]]:
        """A slot for a new block of ``tenant`` (its bytes to be written by the caller), and the entries evicted to
        make room; (None, []) if it cannot be stored."""
        victims = self.index.victims(tenant, self.block_bytes, share)
        if victims is None:
            return None, []
        evicted = []
        for victim in victims:
            entry = self.index.remove(victim)
            self._free_slots.append(entry.handle)
            self.ready.pop(entry.handle, None)
            evicted.append((victim, entry))
        slot = self._free_slots.pop()
        self.index.add(key, Entry(tenant, self.block_bytes, slot))
        return slot, evicted

    def drop(self, key: bytes) -> None:
        entry = self.index.remove(key)
        self._free_slots.append(entry.handle)
        self.ready.pop(entry.handle, None)
