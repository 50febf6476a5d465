"""Process groups of one engine's ranks.

Each rank joins one ``torch.distributed`` world (NCCL on CUDA, gloo on the
CPU) for the model's collectives, plus a gloo group for control messages (the
step's plan, from rank 0 to the others) that works whatever the device. Ranks
find each other through the standard environment (``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, as ``torchrun`` sets
it) or an explicit ``tcp://`` address when moegate spawns them itself.

Every collective has a timeout: a rank whose peer died or hangs fails within
``timeout_s`` with an error that names it, instead of waiting forever.
"""

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.core.config import meeting_address


IDLE_TIMEOUT_S = 7 * 24 * 3600.0
JOIN_TIMEOUT_S = 300.0  # ranks on other nodes may be started by hand, after rank 0
MEET_POLL_S = 0.2  # how often rank 0 looks for the ranks still to arrive (and for ones of its own that died)


class CollectiveError(RuntimeError):
    """A collective did not complete on this rank (a peer died, hung, or the timeout passed)."""


@dataclass(frozen=True, slots=True)
class RankInfo:
    """Where this process sits: its rank among ``world_size``, and the address the ranks meet at."""

    rank: int
    world_size: int
    local_rank: int
    init_method: str

    @classmethod
    def from_env(cls, environ=os.environ) -> "RankInfo":
        """From ``torchrun``'s variables; a clear ValueError naming the one missing or malformed."""
        values = {}
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            if name not in environ:
                raise ValueError(f"{name} is not set (start each rank with torchrun, or set RANK, WORLD_SIZE, "
                                 "MASTER_ADDR and MASTER_PORT)")
            values[name] = environ[name]
        try:
            rank, world = int(values["RANK"]), int(values["WORLD_SIZE"])
            port = int(values["MASTER_PORT"])
            local = int(environ.get("LOCAL_RANK", rank))
        except ValueError as e:
            raise ValueError(f"RANK, WORLD_SIZE, LOCAL_RANK and MASTER_PORT must be integers ({e})") from None
        info = cls(rank, world, local, f"tcp://{values['MASTER_ADDR']}:{port}")
        info.check()
        return info

    def check(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world_size}")


class RankGroups:
    """This rank's process groups: ``device`` for the model's collectives (``timeout_s``), ``control`` (gloo)
    for the step plans rank 0 sends (waits as long as the engine idles)."""

    def __init__(self, info: RankInfo, device: torch.device, timeout_s: float = 30.0,
                 join_timeout_s: float = JOIN_TIMEOUT_S, starting: Callable[[], str | None] | None = None) -> None:
        """Meet the other ranks within ``join_timeout_s`` (rank 0 also gives up as soon as ``starting()``, which
        watches the ranks it started, names one that exited), then form the groups."""
        info.check()
        self.rank, self.world_size, self.timeout_s = info.rank, info.world_size, timeout_s
        self.device = device
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        try:
            store = self._meet(info, join_timeout_s, starting)
            dist.init_process_group(backend, store=store, rank=info.rank, world_size=info.world_size,
                                    timeout=timedelta(seconds=join_timeout_s))
            self.device_group = dist.new_group(backend=backend, timeout=timeout)
            # Followers wait on the control group for the next plan however long the engine idles; a driver
            # that dies still fails that wait at once (its connections close), so only a live but hung driver
            # is bounded by this long timeout, and the gateway ends such an engine process itself.
            self.control_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=IDLE_TIMEOUT_S))
        except CollectiveError:
            raise
        except Exception as e:  # the store did not form: another rank never came, or the address is wrong
            raise CollectiveError(f"rank {info.rank}: could not join the {info.world_size} ranks at "
                                  f"{info.init_method} ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''})") from None

    @staticmethod
    def _meet(info: RankInfo, join_timeout_s: float, starting: Callable[[], str | None] | None) -> dist.Store:
        """The rendezvous store at ``info.init_method`` (rank 0 hosts it), once every rank has said it is there."""
        host, port = meeting_address(info.init_method)
        store = dist.TCPStore(host, port, info.world_size, is_master=info.rank == 0,
                              timeout=timedelta(seconds=join_timeout_s), wait_for_workers=False)
        store.set(f"moegate/joined/{info.rank}", "1")
        if info.rank != 0:
            return store
        keys = [f"moegate/joined/{r}" for r in range(1, info.world_size)]
        deadline = time.monotonic() + join_timeout_s
        # Polled, not waited on with a short timeout: every timed-out wait logs two c10d warnings.
        while not store.check(keys):  # not every rank yet: one of ours may have died, or time may be up
            gone = starting() if starting else None
            if gone:
                raise CollectiveError(f"rank 0: {gone} before the ranks met at {info.init_method}") from None
            if time.monotonic() > deadline:
                missing = [r for r, key in enumerate(keys, start=1) if not store.check([key])]
                raise TimeoutError(f"rank(s) {', '.join(map(str, missing))} did not arrive within {join_timeout_s:g} s")
            time.sleep(MEET_POLL_S)
        return store

    @property
    def first_global_rank(self) -> int:
        """The world rank of this group's rank 0 (the world itself: 0)."""
        return 0

    def subgroup(self, members: list[list[int]], name: str, device: bool = True) -> "Subgroup | None":
        """This rank's part of a partition of some world ranks into groups (``members``: each group's world
        ranks, ascending), with the same timeouts; None if this rank is in none of them. Every rank of the
        world calls it with the same arguments in the same order (``torch.distributed.new_group`` requires it).
        ``device``: a group for the model's collectives too, not only a gloo control group."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        mine = None
        try:
            for ranks in members:
                device_group = dist.new_group(ranks, backend=backend, timeout=timedelta(seconds=self.timeout_s)) \
                    if device else None
                control_group = dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=IDLE_TIMEOUT_S))
                if self.rank in ranks:
                    mine = Subgroup(self, ranks, name, device_group, control_group)
        except Exception as e:
            raise self.fail(f"forming the {name} groups", e) from None
        return mine

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def fail(self, op: str, error: Exception) -> CollectiveError:
        return collective_error(f"rank {self.rank} of {self.world_size}", op, self.timeout_s, error)


class Subgroup:
    """Some of the world's ranks (one replica's tensor-parallel ranks, say), with the interface of
    ``RankGroups`` that the collectives use: ``rank`` of ``world_size`` inside the group."""

    def __init__(self, world: RankGroups, ranks: list[int], name: str, device_group, control_group) -> None:
        self.world, self.ranks, self.name = world, ranks, name
        self.rank, self.world_size = ranks.index(world.rank), len(ranks)
        self.timeout_s, self.device = world.timeout_s, world.device
        self.device_group, self.control_group = device_group, control_group

    @property
    def first_global_rank(self) -> int:
        return self.ranks[0]

    def fail(self, op: str, error: Exception) -> CollectiveError:
        who = f"rank {self.world.rank} of {self.world.world_size} ({self.rank} of its {self.name} group of {self.world_size})"
        return collective_error(who, op, self.timeout_s, error)


def collective_error(who: str, op: str, timeout_s: float, error: Exception) -> CollectiveError:
    """The error a rank raises when ``op`` failed: which rank, what, and the first line of the cause."""
    cause = str(error).splitlines()[0] if str(error) else ""
    return CollectiveError(f"{who}: {op} did not complete within {timeout_s:g} s or a peer rank failed "
                           f"({type(error).__name__}: {cause})")
