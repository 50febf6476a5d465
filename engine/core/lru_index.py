"""Size-bounded LRU bookkeeping with optional per-tenant shares and priority classes, for the prefix-cache tiers
(``engine.kv_tiers``) and the vision encoder's cache (``engine.vision.encoder_cache``). Plain Python.

A tenant with a share ``s`` (0 < s <= 1) may hold at most ``s`` of the tier's bytes: when its new block would
pass that, its own least recently used blocks go, nobody else's. Any insertion that does not fit the tier then
evicts blocks of others (pinned ones, a load in progress, are skipped), in the order of the eviction policy
(``EngineConfig.kv_eviction_policy``, docs/decisions/priority-eviction.md):

- ``lru``: the tier's least recently used blocks first.
- ``priority``: blocks of the least urgent priority class first (a block's class is its tenant's, from
  ``classes``, when it entered the tier); within a class, from the tenant holding the most bytes of it (recounted
  after each victim), each tenant's least recently used first.

The capacity is never exceeded: a block that cannot fit is not stored.
"""

import heapq
from collections import OrderedDict
from dataclasses import dataclass

from engine.core.request_policy import DEFAULT_POLICY


@dataclass(slots=True)
class Entry:
    tenant: str
    size: int
    handle: object  # the tier's own: a slot number (host), a file path (disk)
    pins: int = 0
    priority: int = DEFAULT_POLICY.priority  # its class (lower: more urgent), set by ``LruIndex.add``


class LruIndex:
    def __init__(self, capacity_bytes: int, policy: str = "lru", classes: dict[str, int] | None = None) -> None:
        """``policy``: "lru" or "priority" (see the module). ``classes``: tenant -> priority class, kept up to date
        by the owner (the store); a tenant not there has ``RequestPolicy``'s default class."""
        self.capacity = capacity_bytes
        self.used = 0
        self.entries: OrderedDict[bytes, Entry] = OrderedDict()  # least recently used first
        self.used_by_tenant: dict[str, int] = {}
        self.policy = policy
        self.classes = classes if classes is not None else {}
        # Priority policy: class -> tenant -> its entries of the class, least recently used first.
        self._by_class: dict[int, dict[str, OrderedDict[bytes, Entry]]] = {}
        self._class_bytes: dict[tuple[int, str], int] = {}

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: bytes, touch: bool = True) -> Entry | None:
        entry = self.entries.get(key)
        if entry is not None and touch:
            self.entries.move_to_end(key)
            if self.policy == "priority":
                self._by_class[entry.priority][entry.tenant].move_to_end(key)
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
            if self.policy == "priority":
                freed = self._by_priority(chosen, freed, size)
            else:
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

    def _by_priority(self, chosen: list[bytes], freed: int, size: int) -> int:
        """Append victims to ``chosen`` (holding ``freed`` bytes already) in the priority order until ``size``
        more bytes fit; returns the bytes freed. Per victim: O(log tenants) plus the pinned entries skipped."""
        taken = set(chosen)
        for priority in sorted(self._by_class, reverse=True):  # least urgent class first (a handful of classes)
            tenants = self._by_class[priority]
            left = {t: self._class_bytes[(priority, t)] for t in tenants}
            cursors = {t: iter(entries.items()) for t, entries in tenants.items()}
            heap = [(-held, t) for t, held in left.items()]
            heapq.heapify(heap)
            while heap and self.used - freed + size > self.capacity:
                _, tenant = heapq.heappop(heap)  # the tenant holding the most of the class now
                for key, entry in cursors[tenant]:
                    if entry.pins:
                        continue
                    left[tenant] -= entry.size
                    if key not in taken:
                        chosen.append(key)
                        freed += entry.size
                    heapq.heappush(heap, (-left[tenant], tenant))
                    break
            if self.used - freed + size <= self.capacity:
                break
        return freed

    def add(self, key: bytes, entry: Entry) -> None:
        assert key not in self.entries
        self.entries[key] = entry
        if self.policy == "priority":
            entry.priority = self.classes.get(entry.tenant, DEFAULT_POLICY.priority)
            self._by_class.setdefault(entry.priority, {}).setdefault(entry.tenant, OrderedDict())[key] = entry
            held = (entry.priority, entry.tenant)
            self._class_bytes[held] = self._class_bytes.get(held, 0) + entry.size
        self.used += entry.size
        self.used_by_tenant[entry.tenant] = self.used_by_tenant.get(entry.tenant, 0) + entry.size
        assert self.used <= self.capacity, "a tier grew past its capacity"

    def remove(self, key: bytes) -> Entry:
        entry = self.entries.pop(key)
        self.used -= entry.size
        self.used_by_tenant[entry.tenant] -= entry.size
        if not self.used_by_tenant[entry.tenant]:
            del self.used_by_tenant[entry.tenant]
        if self.policy == "priority":
            tenants = self._by_class[entry.priority]
            del tenants[entry.tenant][key]
            if not tenants[entry.tenant]:
                del tenants[entry.tenant]
                if not tenants:
                    del self._by_class[entry.priority]
            held = (entry.priority, entry.tenant)
            self._class_bytes[held] -= entry.size
            if not self._class_bytes[held]:
                del self._class_bytes[held]
        return entry
