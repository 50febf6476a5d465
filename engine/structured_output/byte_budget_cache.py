"""A least-recently-used cache bounded by the bytes its entries hold, not by their count.

Compiled grammars vary by orders of magnitude in size (a three-field schema's matcher is ~0.1 MB, a
thousand-field one's tens of MB), so a cap on the count bounds nothing. Each entry carries its size (an
estimate where the library does not say); the oldest entries go until the total fits. Thread-safe: the gateway
and the engine fill it from worker threads.
"""

import collections
import threading
from typing import Generic, Hashable, TypeVar

V = TypeVar("V")


class ByteBudgetCache(Generic[V]):
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0  # what the entries kept now hold
        self._entries: collections.OrderedDict[Hashable, tuple[V, int]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def put(self, key: Hashable, value: V, size: int) -> None:
        """Keep ``value`` (``size`` bytes); evict the least recently used until the total fits. An entry larger
        than the whole budget is not kept (its caller still has it)."""
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            if size > self.max_bytes:
                return
            self._entries[key] = (value, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.bytes -= evicted
