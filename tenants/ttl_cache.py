"""A small async cache for policy lookups: bounded staleness, one load at a time, refresh ahead.

An entry is served for ``ttl_s`` after it was loaded and never longer, which
bounds how long a revoked key or a changed quota keeps its old effect. Once an
entry is past ``refresh_fraction`` of its life, the next lookup starts one
background reload and is still answered from the cache, so a busy key never
waits for the database when its entry expires; a key idle past ``ttl_s`` waits
for one load, shared by every request that arrives meanwhile (no stampede).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class RefreshingCache(Generic[V]):
    def __init__(self, ttl_s: float, refresh_fraction: float = 0.6, max_entries: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < refresh_fraction <= 1:
            raise ValueError("refresh_fraction must be in (0, 1]")
        self.ttl_s, self.refresh_s = ttl_s, ttl_s * refresh_fraction
        self.max_entries, self.clock = max_entries, clock
        self._entries: dict[Hashable, tuple[float, V]] = {}  # key -> (loaded at, value)
        self._loading: dict[Hashable, asyncio.Future] = {}

    async def get(self, key: Hashable, load: Callable[[], Awaitable[V]]) -> V:
        hit = self.cached(key, load)
        if hit is not None:
            return hit[0]
        return await asyncio.shield(self._start(key, load))

    def cached(self, key: Hashable, load: Callable[[], Awaitable[V]]) -> tuple[V] | None:
        """``(value,)`` where ``get`` would answer without waiting (starting the same refresh ahead), else None."""
        hit = self._entries.get(key)
        if hit is not None:
            age = self.clock() - hit[0]
            if age < self.refresh_s:
                return (hit[1],)
            if age < self.ttl_s:
                self._start(key, load)  # refresh ahead; this caller keeps the cached value
                return (hit[1],)
        return None

    def peek(self, key: Hashable) -> V | None:
        """The cached value if it is still within its TTL (no load)."""
        hit = self._entries.get(key)
        return hit[1] if hit is not None and self.clock() - hit[0] < self.ttl_s else None

    def clear(self) -> None:
        """Forget every entry: the next lookups load again (a change that must apply at once)."""
        self._entries.clear()

    def _start(self, key: Hashable, load: Callable[[], Awaitable[V]]) -> asyncio.Future:
        future = self._loading.get(key)
        if future is None:
            future = self._loading[key] = asyncio.ensure_future(self._load(key, load))
            future.add_done_callback(lambda f: (self._loading.pop(key, None), f.cancelled() or f.exception()))
        return future

    async def _load(self, key: Hashable, load: Callable[[], Awaitable[V]]) -> V:
        started = self.clock()  # the value is as old as the query that read it
        value = await load()
        if self.ttl_s > 0:
            if len(self._entries) >= self.max_entries:  # bound memory under a flood of random keys
                self._entries.clear()
            self._entries[key] = (started, value)
        return value
