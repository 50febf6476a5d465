"""The collectives tensor and expert parallelism need, over a group of ranks; no-ops for a group of one.

Errors (a dead or hung peer past the group's timeout) become ``CollectiveError``
naming this rank, so an engine fails in seconds with a message, never hangs.

Legend: R rows (tokens or token slots) of this rank, H hidden, N ranks.
"""

import torch
import torch.distributed as dist

from engine.distributed.groups import RankGroups

# The single-tensor forms under their current names (older torch has only the *_tensor names).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class TensorParallel:
    """This rank's place in its group: ``rank`` of ``size``, and the collectives over it.

    ``expert_parallel`` is set (an ``engine.distributed.expert_parallel.ExpertParallel``) when the
    group divides the routed experts among its ranks instead of splitting each one.
    """

    def __init__(self, groups: RankGroups | None = None) -> None:
        self.groups = groups
        self.rank = groups.rank if groups else 0
        self.size = groups.world_size if groups else 1
        self.expert_parallel = None

    @classmethod
    def shape_only(cls, size: int) -> "TensorParallel":
        """Rank 0 of ``size`` ranks with no process group: for building one rank's module shapes (on the meta
        device, say) without running anything; a collective on it fails."""
        tp = cls()
        tp.size = size
        return tp

    def _run(self, what: str, fn, *args, **kwargs) -> None:
        # A group made for control messages only has no device group: group=None would mean the whole world.
        assert kwargs.get("group", True) is not None, f"{what}: this group has no device group"
        try:
            fn(*args, **kwargs)
        except RuntimeError as e:
            raise self.groups.fail(what, e) from None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, in place (the partial sums of a row-parallel layer)."""
        if self.size > 1:
            self._run("all_reduce", dist.all_reduce, x, group=self.groups.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' ``x`` concatenated along ``dim`` in rank order (e.g. vocabulary-parallel logits)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._run("all_gather", dist.all_gather, parts, x.contiguous(), group=self.groups.device_group)
        return torch.cat(parts, dim=dim)

    def all_gather_rows(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [R, ...] of this rank, where rank i has ``counts[i]`` rows -> [sum(counts), ...] in rank order."""
        if self.size == 1:
            return x
        most = max(counts)
        padded = x.new_zeros((most, *x.shape[1:]))  # [max R, ...]: the collective wants equal parts
        padded[:x.shape[0]] = x
        gathered = x.new_empty((self.size * most, *x.shape[1:]))  # [N * max R, ...]
        self._run("all_gather", _all_gather_single, gathered, padded, group=self.groups.device_group)
        return torch.cat([gathered[i * most:i * most + n] for i, n in enumerate(counts)])

    def reduce_scatter_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [N * P, ...], rank i's part at rows [i*P, (i+1)*P) -> this rank's part summed over the ranks [P, ...]."""
        if self.size == 1:
            return x
        out = x.new_empty((x.shape[0] // self.size, *x.shape[1:]))
        self._run("reduce_scatter", _reduce_scatter_single, out, x.contiguous(), group=self.groups.device_group)
        return out

    def all_to_all_rows(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows of x [sum(send_counts), ...] sent in rank order (``send_counts[i]`` to rank i); returns the rows
        received [sum(recv_counts), ...], in the order of the sending ranks."""
        if self.size == 1:
            return x
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        self._run("all_to_all", dist.all_to_all_single, out, x.contiguous(), output_split_sizes=recv_counts,
                  input_split_sizes=send_counts, group=self.groups.device_group)
        return out

    def exchange_counts(self, send_counts: torch.Tensor) -> list[int]:
        """send_counts [N] int64 (rows this rank sends each rank) -> rows each rank sends this one (host ints)."""
        if self.size == 1:
            return send_counts.tolist()
        recv = torch.empty_like(send_counts)
        self._run("all_to_all of counts", dist.all_to_all_single, recv, send_counts, group=self.groups.device_group)
        return recv.tolist()

    def gather_counts(self, n: int, device: torch.device) -> list[int]:
        """Every rank's ``n`` (e.g. its token count this step), in rank order."""
        if self.size == 1:
            return [n]
        return self.all_gather(torch.tensor([n], dtype=torch.int64, device=device), dim=0).tolist()

    def send_recv(self, sends: list[tuple[torch.Tensor, int, int]], recvs: list[tuple[torch.Tensor, int, int]],
                  what: str) -> None:
        """Point to point: each ``(tensor, rank, tag)`` of ``sends`` goes to that rank of this group, each of
        ``recvs`` is filled from that rank by the send with the same tag; returns once all are done (both sides
        must post their messages between a pair of ranks in the same order)."""
        if not sends and not recvs:
            return
        group = self.groups.device_group
        ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, r), group, tag) for t, r, tag in sends]
        ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, r), group, tag) for t, r, tag in recvs]
        try:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        except RuntimeError as e:
            raise self.groups.fail(what, e) from None

    def min_over_ranks(self, value: int, what: str = "agreeing on the KV cache size") -> int:
        """The smallest ``value`` any rank holds (e.g. the KV blocks every rank's memory allows), over the control group."""
        return self._control_reduce(value, dist.ReduceOp.MIN, what)

    def max_over_ranks(self, value: int, what: str) -> int:
        """The largest ``value`` any rank holds (e.g. whether any has work), over the control group."""
        return self._control_reduce(value, dist.ReduceOp.MAX, what)

    def _control_reduce(self, value: int, op, what: str) -> int:
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        self._run(what, dist.all_reduce, t, op=op, group=self.groups.control_group)
        return int(t.item())

    def broadcast_object(self, obj=None):
        """Rank 0's ``obj`` on every rank (the step's plan), over the control group."""
        if self.size == 1:
            return obj
        box = [obj if self.rank == 0 else None]
        self._run("broadcast of the step's plan", dist.broadcast_object_list, box, src=self.groups.first_global_rank,
                  group=self.groups.control_group)
        return box[0]

    def broadcast_bytes(self, data: bytes | None = None, what: str = "broadcast of a rank message") -> bytes:
        """Rank 0's ``data`` on every rank (an encoded control message, ``engine.worker.rank_messages``), over
        the control group: its length, then its bytes. Others pass None."""
        if self.size == 1:
            return data
        src = self.groups.first_global_rank
        length = torch.tensor([len(data) if self.rank == 0 else 0], dtype=torch.int64)
        self._run(what, dist.broadcast, length, src=src, group=self.groups.control_group)
        if self.rank == 0:
            buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buffer = torch.empty(int(length.item()), dtype=torch.uint8)
        self._run(what, dist.broadcast, buffer, src=src, group=self.groups.control_group)
        return data if self.rank == 0 else buffer.numpy().tobytes()

    def broadcast(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """Rank 0's ``x`` on every rank, over the device group: the others pass a tensor of the same shape and
        dtype, filled in place (e.g. the step's image features, ``engine.models.image_step``)."""
        if self.size > 1 and x.numel():
            self._run(what, dist.broadcast, x, src=self.groups.first_global_rank, group=self.groups.device_group)
        return x

    def broadcast_ints(self, values: list[int] | None, count: int, what: str) -> list[int]:
        """Rank 0's ``count`` host ints on every rank (the others pass None), over the control group: sizes a
        follower needs before a ``broadcast`` of tensors, read without a device sync."""
        if self.size == 1:
            return values
        box = torch.tensor(values if self.rank == 0 else [0] * count, dtype=torch.int64)
        self._run(what, dist.broadcast, box, src=self.groups.first_global_rank, group=self.groups.control_group)
        return box.tolist()

    def all_gather_object(self, obj) -> list:
        """Every rank's ``obj``, in rank order, on every rank (over the control group)."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        self._run("gathering what every rank is", dist.all_gather_object, out, obj, group=self.groups.control_group)
        return out

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal share of ``total`` items; ValueError if they do not divide."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size ({self.size})")
        length = total // self.size
        return self.rank * length, length

    def split(self, total: int) -> list[int]:
        """Each rank's share of ``total`` items that need not divide (the first ``total % size`` get one more)."""
        base, extra = divmod(total, self.size)
        return [base + (i < extra) for i in range(self.size)]


SINGLE = TensorParallel()  # one rank: every collective is a no-op
