"""Which LoRA adapter sits in which device slot: the scheduler's side (rank 0) of serving more adapters than slots.

Registered adapters (name -> directory) may outnumber the ``max_loras`` device slots. Slots are an LRU over
adapters; a slot is reused only when no running request uses its adapter (running requests pin theirs). A waiting
request whose adapter is not in a slot is set aside by the scheduler (not running, not blocking others) while the
adapter's factors are read into host memory off the step loop (``HostReads``); once they are there and a slot is
free or evictable, the plan of the next step carries the slot write (``LoraLoad``), which every rank does before
that step's forward. Plain Python, no torch.
"""

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class LoraLoad:
    """Write adapter ``name`` (read from ``path``) into device slot ``slot`` (1..max_loras) before the step's forward."""

    slot: int
    name: str
    path: str


@dataclass(frozen=True, slots=True)
class LoraLoads:
    """The slot writes of one step, sent to the other ranks on the plans' channel ahead of the step's plan."""

    loads: tuple[LoraLoad, ...]


class HostReads(Protocol):
    """The host-memory stage of adapter factors (``engine.lora.host_cache.HostLoraCache``)."""

    def ready(self, name: str, path: str) -> bool:
        """Whether the factors are in host memory now; if not, start reading them in the background."""

    def discard(self, name: str, path: str) -> None:
        """Forget the factors (a removed adapter)."""


class LoraResidency:
    """Registered adapters, device slots (an LRU over adapters) and the counters of slot loads and evictions."""

    def __init__(self, max_loras: int, host: HostReads) -> None:
        self.max_loras = max_loras
        self.host = host
        self.paths: dict[str, str] = {}  # registered adapters and removed ones that still have requests
        self.removed: set[str] = set()  # removed: refused for new requests, dropped once their last request ends
        self.bound: dict[str, str] = {}  # every name ever registered: its directory (cached prefixes are keyed by name)
        self.live: dict[str, int] = {}  # unfinished requests per adapter (waiting, set aside, running)
        self.slots: OrderedDict[str, int] = OrderedDict()  # resident adapter -> slot, least recently used first
        self.free = list(range(max_loras, 0, -1))  # free slots, popped from the end (slot 1 first)
        self.slot_loads = 0  # cumulative: adapters written into a slot
        self.slot_evictions = 0  # cumulative: resident adapters whose slot was given to another

    # ---- registration -------------------------------------------------------
    def names(self) -> list[str]:
        """Registered adapters (not removed), in registration order."""
        return [n for n in self.paths if n not in self.removed]

    def is_registered(self, name: str) -> bool:
        return name in self.paths and name not in self.removed

    def check_new(self, name: str, path: str) -> bool:
        """False if ``name`` is registered with ``path`` already (nothing to do); ValueError if another directory
        holds the name now, or held it earlier in this engine (cached prefix blocks are keyed by the name)."""
        if not name or "," in name or "=" in name:
            raise ValueError(f"lora adapter name {name!r} must be non-empty without ',' or '='")
        held = self.bound.get(name)
        if held is not None and held != path:
            when = "is" if self.is_registered(name) else "was"
            raise ValueError(f"lora adapter {name!r} {when} registered with {held}, not {path}: pick another name")
        if self.is_registered(name):
            return False
        if name in self.removed:
            raise ValueError(f"lora adapter {name!r} is being removed (its requests are still running): "
                             "add it again once they finish")
        return True

    def register(self, name: str, path: str) -> None:
        self.paths[name] = self.bound[name] = path

    def remove(self, name: str) -> None:
        """Refuse new requests for ``name`` from now on; the ones already accepted finish under it (as vLLM lets
        requests in flight finish), then its slot and host copy are dropped."""
        if not self.is_registered(name):
            raise ValueError(f"lora adapter {name!r} is not registered (registered: {self.names()})")
        self.removed.add(name)
        if not self.live.get(name):
            self._drop(name)

    def _drop(self, name: str) -> None:
        path = self.paths.pop(name)
        self.removed.discard(name)
        self.live.pop(name, None)
        slot = self.slots.pop(name, None)
        if slot is not None:
            self.free.append(slot)
        self.host.discard(name, path)

    # ---- requests -----------------------------------------------------------
    def request_added(self, name: str) -> None:
        if name not in self.paths:  # a copy of an n > 1 request accepted before its adapter was removed
            self.paths[name] = self.bound[name]
            self.removed.add(name)
        self.live[name] = self.live.get(name, 0) + 1

    def request_ended(self, name: str) -> None:
        self.live[name] -= 1
        if not self.live[name] and name in self.removed:
            self._drop(name)

    def slot(self, name: str) -> int | None:
        """The adapter's slot if it is resident (and marks it used now), else None."""
        slot = self.slots.get(name)
        if slot is not None:
            self.slots.move_to_end(name)
        return slot

    def prefetch(self, name: str) -> None:
        """A request for ``name`` waits for a slot: start reading its factors into host memory now."""
        self.host.ready(name, self.paths[name])

    # ---- between steps --------------------------------------------------------
    def plan_loads(self, wanted: list[str], in_use: set[str]) -> list[LoraLoad]:
        """Slot writes for the next step: each ``wanted`` adapter (in order) whose factors are in host memory gets
        a free slot, or the least recently used slot whose adapter no running request uses (``in_use``)."""
        loads: list[LoraLoad] = []
        loaded: set[str] = set()  # written this step: not evictable by the next wanted one
        for name in wanted:
            if name in self.slots or name not in self.paths:
                continue
            path = self.paths[name]
            if not self.host.ready(name, path):
                continue  # read in the background; asked again next step
            if self.free:
                slot = self.free.pop()
            else:
                victim = next((n for n in self.slots if n not in in_use and n not in loaded), None)
                if victim is None:
                    break  # every slot is pinned by running requests: wait for one to finish
                slot = self.slots.pop(victim)
                self.slot_evictions += 1
            self.slots[name] = slot
            self.slot_loads += 1
            loaded.add(name)
            loads.append(LoraLoad(slot, name, path))
        return loads
