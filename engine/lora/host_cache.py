"""LoRA adapters' factors in host memory: an LRU of at most ``max_cpu_loras`` adapters, filled by a background
thread so the disk read and the safetensors parse never run inside the step loop (the thread waits while a
reader process parses, where there is one: ``engine.lora.reader_process``).

The scheduler asks ``ready`` (starting a read if the factors are absent); the slot write between two steps
``take``s them (read synchronously only if they were evicted in between, counted as ``sync_reads``). A background
read that fails (the directory changed since the adapter was added: gone, or its weights no longer finite) is
kept as a one-line reason until the engine takes it (``failures``) and ends the requests waiting for it.
"""

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from engine.lora.peft_format import LoraAdapter

logger = logging.getLogger(__name__)
# A slot write waits this long for a read of its adapter already in flight before reading the file itself.
PENDING_READ_WAIT_S = 30.0


class HostLoraCache:
    """(name, path) -> parsed adapter, least recently used first; counters for the engine's stats."""

    def __init__(self, capacity: int, read: Callable[[str, str], LoraAdapter],
                 background_read: Callable[[str, str], LoraAdapter] | None = None) -> None:
        """``read(name, path)``: the parsed, checked adapter (``LoraAdapters.read``); ``background_read``: the
        same, as the background thread does it (default ``read``)."""
        self.capacity = capacity
        self._read = read
        self._background = background_read or read
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, str], LoraAdapter] = OrderedDict()
        self._pending: dict[tuple[str, str], Future] = {}
        self._claimed: set[tuple[str, str]] = set()  # planned into a slot, not yet taken: never evicted
        self._failed: dict[tuple[str, str], str] = {}  # background reads that failed, and why (one line)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-read")
        self.hits = 0  # cumulative: slot writes served from host memory
        self.misses = 0  # cumulative: reads from disk (background or synchronous)
        self.evictions = 0  # cumulative: adapters dropped from host memory for room
        self.sync_reads = 0  # cumulative: slot writes that had to read the disk themselves
        self.read_seconds = 0.0  # cumulative time of the disk reads and parses

    def put(self, name: str, path: str, adapter: LoraAdapter) -> None:
        """Keep an adapter read elsewhere (the check when it is added)."""
        with self._lock:
            self._insert((name, path), adapter)

    def ready(self, name: str, path: str) -> bool:
        """Whether the factors are in host memory now (marks them used); if not, start reading them (once)."""
        key = (name, path)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return True
            if key not in self._pending:
                self.misses += 1
                self._pending[key] = self._pool.submit(self._background_read, key)
            return False

    def claim(self, name: str, path: str) -> bool:
        """``ready``, and if the factors are here, keep them until ``take`` (a slot write planned for them)."""
        with self._lock:
            if (name, path) in self._entries:
                self._claimed.add((name, path))
        return self.ready(name, path)

    def take(self, name: str, path: str) -> LoraAdapter:
        """The factors, for a slot write: from host memory (after the background read of them in flight, if one
        is: a follower rank's read may start just before its slot write), or read now if they were evicted."""
        key = (name, path)
        with self._lock:
            pending = self._pending.get(key)
        if pending is not None:
            wait([pending], timeout=PENDING_READ_WAIT_S)
        with self._lock:
            self._claimed.discard(key)
            adapter = self._entries.get(key)
            if adapter is not None:
                self.hits += 1
                if len(self._entries) > self.capacity:  # a claim kept more: the oldest unclaimed go (this one
                    self._evict()  # first if it is the oldest: it has its slot now)
                else:
                    self._entries.move_to_end(key)
                return adapter
            self.misses += 1
            self.sync_reads += 1
        adapter = self._timed_read(key, self._read)
        with self._lock:
            self._insert(key, adapter)
        return adapter

    @property
    def reading(self) -> bool:
        """Whether a background read is in flight now."""
        return bool(self._pending)

    def wait_for_reads(self, timeout_s: float) -> None:
        """Block until a background read ends (or ``timeout_s``): for an engine with nothing to run but requests
        waiting for adapters, instead of spinning on empty steps (which would also slow the reader)."""
        with self._lock:
            pending = list(self._pending.values())
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def failures(self) -> dict[tuple[str, str], str]:
        """The background reads that failed since the last call: (name, path) -> why, in one line. A later
        ``ready`` for the same adapter reads it again (its directory may have been mended)."""
        with self._lock:
            failed, self._failed = self._failed, {}
        return failed

    def discard(self, name: str, path: str) -> None:
        with self._lock:
            self._entries.pop((name, path), None)
            self._claimed.discard((name, path))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _background_read(self, key: tuple[str, str]) -> None:
        try:
            adapter = self._timed_read(key, self._background)
        except Exception as e:  # the directory changed since it was added: its waiting requests fail (``failures``)
            logger.error("LoRA adapter %s: reading %s failed: %s", key[0], key[1], e)
            with self._lock:
                self._pending.pop(key, None)
                self._failed[key] = " ".join(str(e).split()) or type(e).__name__
            return
        with self._lock:
            self._pending.pop(key, None)
            self._insert(key, adapter)

    def _timed_read(self, key: tuple[str, str], read: Callable[[str, str], LoraAdapter]) -> LoraAdapter:
        start = time.perf_counter()
        adapter = read(*key)
        self.read_seconds += time.perf_counter() - start
        return adapter

    def _insert(self, key: tuple[str, str], adapter: LoraAdapter) -> None:
        self._entries[key] = adapter
        self._entries.move_to_end(key)
        self._evict(keep=key)

    def _evict(self, keep: tuple[str, str] | None = None) -> None:
        """Drop the least recently used entries down to the capacity, but neither claimed ones nor ``keep`` (just
        read for a waiting request): those may exceed it until the claims are taken."""
        for key in [k for k in self._entries if k not in self._claimed and k != keep]:
            if len(self._entries) <= self.capacity:
                break
            del self._entries[key]
            self.evictions += 1
