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
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


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
    """This rank's process groups: ``device`` for the model's collectives, ``control`` (gloo) for plans."""

    def __init__(self, info: RankInfo, device: torch.device, timeout_s: float = 30.0) -> None:
        info.check()
        self.rank, self.world_size, self.timeout_s = info.rank, info.world_size, timeout_s
        self.device = device
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        try:
            dist.init_process_group(backend, init_method=info.init_method, rank=info.rank,
                                    world_size=info.world_size, timeout=timeout)
        except Exception as e:  # the store did not form: another rank never came, or the address is wrong
            raise CollectiveError(f"rank {info.rank}: could not join the {info.world_size} ranks at "
                                  f"{info.init_method} within {timeout_s:g} s ({type(e).__name__}: {e})") from None
        self.device_group = dist.group.WORLD
        self.control_group = self.device_group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)

    @property
    def is_driver(self) -> bool:
        """Rank 0 runs the scheduler and talks to the gateway; the others follow its plans."""
        return self.rank == 0

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def fail(self, op: str, error: Exception) -> CollectiveError:
        return CollectiveError(f"rank {self.rank} of {self.world_size}: {op} did not complete within "
                               f"{self.timeout_s:g} s or a peer rank failed ({type(error).__name__}: "
                               f"{str(error).splitlines()[0] if str(error) else ''})")
