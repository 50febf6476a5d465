"""Size-bounded LRU bookkeeping of one tier, with optional per-tenant shares. Plain Python.

Default is one shared LRU. A tenant with a share ``s`` (0 < s <= 1) may hold at most ``s`` of the tier's
bytes: when its new block would pass that, its own least recently used blocks go, nobody else's. Any
insertion that does not fit the tier evicts the tier's least recently used blocks (pinned ones, a load
in progress, are skipped). The capacity is never exceeded: a block that cannot fit is not stored.
"""

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class Entry:
    tenant: str
    size: int
    handle: object  # the tier's own: a slot number (host), a file path (disk)
    pins: int = 0


class LruIndex:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.used = 0
        self.entries: OrderedDict[bytes, Entry] = OrderedDict()  # least recently used first
        self.used_by_tenant: dict[str, int] = {}

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: bytes, touch: bool = True) -> Entry | None:
        entry = self.entries.get(key)
        if entry is not None and touch:
            self.entries.move_to_end(key)
        return entry

    def victims(self, tenant: str, size: int, share: float | None) -> list[bytes] | None:
        """Keys to evict so that a new ``size``-byte block of ``tenant`` fits (in eviction order), or None if it
        cannot fit (larger than the tier or the share, or everything evictable is pinned). Changes nothing."""
        if size > self.capacity:
            return None
        chosen: list[bytes] = []
        freed = 0
        freed_own = 0
        if share is not None:
            limit = share * self.capacity
            own = self.used_by_tenant.get(tenant, 0)
            if size > limit:
                return None
            for key, entry in self.entries.items():
                if own - freed_own + size <= limit:
                    break
                if entry.tenant == tenant and not entry.pins:
                    chosen.append(key)
                    freed_own += entry.size
            if own - freed_own + size > limit:
                return None
            freed = freed_own
        if self.used - freed + size > self.capacity:
            taken = set(chosen)
            for key, entry in self.entries.items():
                if self.used - freed + size <= self.capacity:
                    break
                if key not in taken and not entry.pins:
                    chosen.append(key)
                    freed += entry.size
            if self.used - freed + size > self.capacity:
                return None
        return chosen

    def add(self, key: bytes, entry: Entry) -> None:
        assert key not in self.entries
        self.entries[key] = entry
        self.used += entry.size
        self.used_by_tenant[entry.tenant] = self.used_by_tenant.get(entry.tenant, 0) + entry.size
        assert self.used <= self.capacity, "a tier grew past its capacity"

    def remove(self, key: bytes) -> Entry:
        entry = self.entries.pop(key)
        self.used -= entry.size
        self.used_by_tenant[entry.tenant] -= entry.size
        if not self.used_by_tenant[entry.tenant]:
            del self.used_by_tenant[entry.tenant]
        return entry
