"""Pipeline parallelism: which layers a stage holds, and the point-to-point transfers between stages.

An engine of ``pipeline_parallel_size`` P stages of ``tensor_parallel_size`` T
ranks is a world of P x T ranks: stage s is world ranks [s*T, (s+1)*T), and
rank t of a stage talks only to rank t of the stages beside it (the same slice
of the model's tensor-parallel split). Stage 0 holds the embedding, the LM
head and the sampler (world rank 0 schedules); the last stage holds the final
norm and sends the normalised hidden rows that are sampled back to stage 0.

Legend: T tokens of a micro-batch, H hidden, N rows sent back (sampled rows).
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from engine.distributed.collectives import TensorParallel
from engine.distributed.groups import RankGroups


def stage_layers(num_layers: int, num_stages: int, stage: int) -> tuple[int, int]:
    """[start, end) of the layers stage ``stage`` holds: equal shares, the remainder to the last stages (stage 0
    also runs the LM head and the sampler). ValueError when a stage would get no layer."""
    if num_layers < num_stages:
        raise ValueError(f"pipeline_parallel_size ({num_stages}) exceeds the model's {num_layers} layers: "
                         "every stage needs at least one layer")
    base, extra = divmod(num_layers, num_stages)
    sizes = [base + (s >= num_stages - extra) for s in range(num_stages)]
    start = sum(sizes[:stage])
    return start, start + sizes[stage]


@dataclass(slots=True)
class StageTiming:
    """Where one rank's step time went: ``busy_s`` computing its stage, ``wait_s`` waiting for transfers
    (receiving from the stage before it, on stage 0 the rows back from the last one, and the step's sends to
    complete), both wall time;
    ``busy_cpu_s`` the CPU time of this rank's thread in ``busy_s`` (on a machine whose cores are shared,
    busy wall time minus it is time the rank was ready but not running)."""

    stage: int
    busy_s: float = 0.0
    wait_s: float = 0.0
    busy_cpu_s: float = 0.0
    steps: int = 0
    empty_micro_batches: int = 0
    # Steps stage 0 began while the step before was still in flight (overlapped pipelined steps).
    overlapped_steps: int = 0


@dataclass(slots=True)
class PipelineStage:
    """This rank's stage: ``stage`` of ``num_stages``, its layers [``start``, ``end``), and (on a live world)
    ``plans``: the whole engine's control group (plans reach every stage), ``groups`` for the transfers.
    The default is the whole model on one stage."""

    stage: int = 0
    num_stages: int = 1
    start: int = 0
    end: int | None = None  # None: every layer
    plans: TensorParallel | None = None
    groups: RankGroups | None = None
    tp_size: int = 1
    timing: StageTiming = field(default_factory=lambda: StageTiming(0))
    # The last step's sends, (work, tensor): waited at the end of the next step (engine.worker.pipeline_step).
    pending_sends: list = field(default_factory=list)

    @classmethod
    def of(cls, groups: RankGroups, tp_size: int, num_layers: int) -> "PipelineStage":
        stage = groups.rank // tp_size
        num_stages = groups.world_size // tp_size
        start, end = stage_layers(num_layers, num_stages, stage)
        return cls(stage, num_stages, start, end, TensorParallel(groups), groups, tp_size, StageTiming(stage))

    @property
    def pipelined(self) -> bool:
        return self.num_stages > 1

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def holds_layer(self, index: int) -> bool:
        return self.start <= index and (self.end is None or index < self.end)

    def peer(self, stage: int) -> int:
        """World rank of this rank's tensor-parallel place in ``stage``."""
        return stage * self.tp_size + self.groups.rank % self.tp_size

    def send(self, x: torch.Tensor, stage: int) -> "dist.Work":
        """Start sending x to this rank's peer in ``stage``; the caller waits on the returned work before
        reusing x."""
        return self._run(f"send to stage {stage} (rank {self.peer(stage)})", dist.isend, x.contiguous(),
                         self.peer(stage))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, stage: int) -> torch.Tensor:
        """The tensor of ``shape`` this rank's peer in ``stage`` sends."""
        work, out = self.irecv(shape, dtype, device, stage)
        self.wait(work, f"receive from stage {stage} (rank {self.peer(stage)})")
        return out

    def irecv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
              stage: int) -> tuple["dist.Work", torch.Tensor]:
        """Start receiving the tensor of ``shape`` this rank's peer in ``stage`` sends: (work, tensor), the
        tensor filled once ``wait(work)`` returns."""
        out = torch.empty(shape, dtype=dtype, device=device)
        return self._run(f"receive from stage {stage} (rank {self.peer(stage)})", dist.irecv, out, self.peer(stage)), out

    def wait(self, work, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            raise self.groups.fail(what, e) from None

    def _run(self, what: str, fn, x: torch.Tensor, peer: int):
        try:
            return fn(x, peer, group=self.groups.device_group)
        except RuntimeError as e:
            raise self.groups.fail(what, e) from None


WHOLE = PipelineStage()  # one stage: every layer, the embedding and the head
