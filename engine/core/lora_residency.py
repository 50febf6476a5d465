"""Which LoRA adapter sits in which device slot: the scheduler's side (rank 0) of serving more adapters than slots.

Registered adapters (name -> directory) may outnumber the ``max_loras`` device slots. Slots are an LRU over
adapters; a slot is reused only when no running request uses its adapter (running requests pin theirs). A waiting
request whose adapter is not in a slot is set aside by the scheduler (not running, not blocking others) while the
adapter's factors are read into host memory off the step loop (``HostReads``); once they are there and a slot is
free or evictable, the plan of the next step carries the slot write (``LoraLoad``), which every rank does before
that step's forward. Plain Python, no torch.

A registration is keyed by its name, directory and the digest of its files' content (``registration_key``): a name
removed and added again from another directory, or from the same one with other weights, is another adapter here
(its own slot, its own cached prompt blocks, in every prefix-cache tier and across restarts), so requests still
running under the earlier weights finish under them while new ones get the new ones.
"""

from collections import OrderedDict
from typing import Protocol

import msgspec


def registration_key(name: str, path: str, digest: str) -> str:
    """What requests, slots, host copies and cached prompt blocks know a registered adapter by: its name, directory
    and content digest (``engine.lora.identity.adapter_digest``; names hold no ``=``, so a key is never a name)."""
    return f"{name}={path}#{digest}"


def registered_name(key: str) -> str:
    """The name users gave the adapter of ``registration_key`` ``key``."""
    return key.split("=", 1)[0]


def registered_digest(key: str) -> str | None:
    """The content digest ``registration_key`` ``key`` was made with (None for a bare name: no registration)."""
    return key.rsplit("#", 1)[1] if "=" in key and "#" in key else None


class LoraLoad(msgspec.Struct, frozen=True, array_like=True):
    """Write the adapter registered as ``name`` (a ``registration_key``; read from ``path``) into device slot
    ``slot`` (1..max_loras) before the step's forward."""

    slot: int
    name: str
    path: str


class LoraReads(msgspec.Struct, frozen=True, tag=True):
    """Adapters (registration key, directory) whose reads rank 0 began this step, sent to the other ranks so that
    they read their copies in the background too, ahead of the slot writes (instead of inside that step)."""

    reads: tuple[tuple[str, str], ...]


class LoraLoads(msgspec.Struct, frozen=True, tag=True):
    """The slot writes of one step, sent to the other ranks on the plans' channel ahead of the step's plan."""

    loads: tuple[LoraLoad, ...]


class HostReads(Protocol):
    """The host-memory stage of adapter factors (``engine.lora.host_cache.HostLoraCache``)."""

    def ready(self, name: str, path: str) -> bool:
        """Whether the factors are in host memory now; if not, start reading them in the background."""

    def claim(self, name: str, path: str) -> bool:
        """``ready``, and if so keep the factors in host memory until the slot write takes them (a background
        read finishing meanwhile must not evict an adapter planned into a slot)."""

    def discard(self, name: str, path: str) -> None:
        """Forget the factors (a removed adapter)."""


class LoraResidency:
    """Registered adapters, device slots (an LRU over adapters) and the counters of slot loads and evictions.

    Requests name their adapter by its ``registration_key`` (``LLMEngine.add_request`` puts it in their policy);
    ``check_new``, ``register``, ``remove``, ``names`` and ``is_registered`` take the names users gave."""

    def __init__(self, max_loras: int, host: HostReads) -> None:
        self.max_loras = max_loras
        self.host = host
        self.current: dict[str, str] = {}  # registered name -> its key, in registration order
        self.paths: dict[str, str] = {}  # key -> directory: registered keys and removed ones that still have requests
        self.removed: set[str] = set()  # keys removed: refused for new requests, dropped once their last one ends
        self.bound: dict[str, str] = {}  # every key ever registered: its directory
        self.live: dict[str, int] = {}  # unfinished requests per key (waiting, set aside, running)
        self.slots: OrderedDict[str, int] = OrderedDict()  # resident key -> slot, least recently used first
        self.free = list(range(max_loras, 0, -1))  # free slots, popped from the end (slot 1 first)
        self.slot_loads = 0  # cumulative: adapters written into a slot
        self.slot_evictions = 0  # cumulative: resident adapters whose slot was given to another

    # ---- registration (by name) ---------------------------------------------
    def names(self) -> list[str]:
        """Registered adapters (not removed), in registration order."""
        return list(self.current)

    def is_registered(self, name: str) -> bool:
        return name in self.current

    def key(self, name: str) -> str:
        """The registration key of registered adapter ``name``, for its requests."""
        return self.current[name]

    def check_new(self, name: str, path: str) -> bool:
        """False if ``name`` is registered with ``path`` already (nothing to do); ValueError if it is registered
        with another directory (remove it first). A name removed earlier may be added again, with any directory."""
        if not name or "," in name or "=" in name:
            raise ValueError(f"lora adapter name {name!r} must be non-empty without ',' or '='")
        held = self.current.get(name)
        if held is not None and self.paths[held] != path:
            raise ValueError(f"lora adapter {name!r} is registered with {self.paths[held]}, not {path}: "
                             "remove it first")
        return held is None

    def register(self, name: str, path: str, key: str) -> None:
        """Serve ``name`` from ``path`` for new requests, under ``key`` (``registration_key``; the same key removed
        while requests still ran under it: those and the new ones share the registration)."""
        self.current[name] = key
        self.paths[key] = self.bound[key] = path
        self.removed.discard(key)

    def remove(self, name: str) -> None:
        """Refuse new requests for ``name`` from now on; the ones already accepted finish under it (as vLLM lets
        requests in flight finish), then its slot and host copy are dropped."""
        if not self.is_registered(name):
            raise ValueError(f"lora adapter {name!r} is not registered (registered: {self.names()})")
        key = self.current.pop(name)
        self.removed.add(key)
        if not self.live.get(key):
            self._drop(key)

    def _drop(self, key: str) -> None:
        path = self.paths.pop(key)
        self.removed.discard(key)
        self.live.pop(key, None)
        slot = self.slots.pop(key, None)
        if slot is not None:
            self.free.append(slot)
        self.host.discard(key, path)

    # ---- requests (by key) -----------------------------------------------------
    def request_added(self, key: str) -> None:
        if key not in self.paths:  # a copy of an n > 1 request accepted before its adapter was removed
            self.paths[key] = self.bound[key]
            self.removed.add(key)
        self.live[key] = self.live.get(key, 0) + 1

    def request_ended(self, key: str) -> None:
        self.live[key] -= 1
        if not self.live[key] and key in self.removed:
            self._drop(key)

    def slot(self, key: str) -> int | None:
        """The adapter's slot if it is resident (and marks it used now), else None."""
        slot = self.slots.get(key)
        if slot is not None:
            self.slots.move_to_end(key)
        return slot

    def prefetch(self, key: str) -> tuple[str, str]:
        """A request for ``key`` waits for a slot: start reading its factors into host memory now. Returns what
        the other ranks read too (``LoraReads``)."""
        self.host.ready(key, self.paths[key])
        return key, self.paths[key]

    # ---- between steps --------------------------------------------------------
    def plan_loads(self, wanted: list[str], in_use: set[str]) -> list[LoraLoad]:
        """Slot writes for the next step: each ``wanted`` adapter (keys, in order) whose factors are in host memory
        gets a free slot, or the least recently used slot whose adapter no running request uses (``in_use``)."""
        loads: list[LoraLoad] = []
        loaded: set[str] = set()  # written this step: not evictable by the next wanted one
        for name in wanted:
            if name in self.slots or name not in self.paths:
                continue
            path = self.paths[name]
            victim = None
            if not self.free:
                victim = next((n for n in self.slots if n not in in_use and n not in loaded), None)
                if victim is None:
                    self.host.ready(name, path)  # its read goes on meanwhile
                    break  # every slot is pinned by running requests: wait for one to finish
            if not self.host.claim(name, path):
                continue  # read in the background; asked again next step
            if victim is None:
                slot = self.free.pop()
            else:
                slot = self.slots.pop(victim)
                self.slot_evictions += 1
            self.slots[name] = slot
            self.slot_loads += 1
            loaded.add(name)
            loads.append(LoraLoad(slot, name, path))
        return loads
