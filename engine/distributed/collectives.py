"""The collectives tensor parallelism needs, over a group of ranks; no-ops for a group of one.

Errors (a dead or hung peer past the group's timeout) become ``CollectiveError``
naming this rank, so an engine fails in seconds with a message, never hangs.
"""

import torch
import torch.distributed as dist

from engine.distributed.groups import RankGroups


class TensorParallel:
    """This rank's place in its tensor-parallel group: ``rank`` of ``size``, and the collectives over it."""

    def __init__(self, groups: RankGroups | None = None) -> None:
        self.groups = groups
        self.rank = groups.rank if groups else 0
        self.size = groups.world_size if groups else 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, in place (the partial sums of a row-parallel layer)."""
        if self.size == 1:
            return x
        try:
            dist.all_reduce(x, group=self.groups.device_group)
        except RuntimeError as e:
            raise self.groups.fail("all_reduce", e) from None
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' ``x`` concatenated along ``dim`` in rank order (e.g. vocabulary-parallel logits)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        try:
            dist.all_gather(parts, x.contiguous(), group=self.groups.device_group)
        except RuntimeError as e:
            raise self.groups.fail("all_gather", e) from None
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj=None):
        """Rank 0's ``obj`` on every rank (the step's plan), over the control group."""
        if self.size == 1:
            return obj
        box = [obj if self.rank == 0 else None]
        try:
            dist.broadcast_object_list(box, src=0, group=self.groups.control_group)
        except RuntimeError as e:
            raise self.groups.fail("broadcast of the step's plan", e) from None
        return box[0]

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal share of ``total`` items; ValueError if they do not divide."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size ({self.size})")
        length = total // self.size
        return self.rank * length, length


SINGLE = TensorParallel()  # one rank: every collective is a no-op
