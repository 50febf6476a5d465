"""The collectives of one rank of an engine's world: its replica's tensor-parallel group, the group of the
replicas' engine processes, its pipeline stage, formed the same way on every rank (the engine process's and the
follower ranks')."""

from dataclasses import dataclass, field

from engine.distributed.collectives import TensorParallel
from engine.distributed.expert_parallel import ExpertParallel
from engine.distributed.groups import RankGroups
from engine.distributed.pipeline import PipelineStage
from engine.distributed.replica_layout import replica_world_ranks
from engine.distributed.world import ReplicaClaim


@dataclass(frozen=True, slots=True)
class ParallelGroups:
    """This rank's collectives: ``tp`` over its replica's ranks (the model's tensor parallelism; its
    ``expert_parallel`` divides the experts among every replica's ranks), and ``drivers`` over the
    replicas' rank-0 processes (on those only, when several replicas share their experts)."""

    tp: TensorParallel
    drivers: TensorParallel | None
    # The group the engine process's plans (and its config) go over: its tensor-parallel ranks, or every stage's.
    plans: TensorParallel
    stage: PipelineStage = field(default_factory=PipelineStage)


def parallel_groups(groups: RankGroups, world: ReplicaClaim) -> ParallelGroups:
    """The groups of an engine's world of ``data_parallel_size`` x ``tensor_parallel_size`` ranks (replica d is
    world ranks [d*T, (d+1)*T)), laid out as ``world`` (world rank 0's claim, checked by ``agree_on_world``), with
    the experts divided among all of them if it says so. Every rank of the world calls it, in the same order as
    its other collectives."""
    replicas, split = world.data_parallel_size, world.tensor_parallel_size
    everyone = TensorParallel(groups)
    if world.pipeline_parallel_size > 1:  # one engine (config checks): stage s is world ranks [s*T, (s+1)*T)
        stages = [list(range(s * split, (s + 1) * split)) for s in range(world.pipeline_parallel_size)]
        tp = TensorParallel(groups.subgroup(stages, "tensor-parallel")) if split > 1 else TensorParallel()
        if world.enable_expert_parallel and split > 1:  # the experts are divided inside each stage
            tp.expert_parallel = ExpertParallel(tp, world.expert_dispatch)
        stage = PipelineStage.of(groups, split, world.model_shape[2])
        return ParallelGroups(tp, None, stage.plans, stage)
    if replicas == 1:
        tp, drivers = everyone, None
    else:
        layout = replica_world_ranks(replicas, split)
        tp = TensorParallel(groups.subgroup(layout, "tensor-parallel")) if split > 1 else TensorParallel()
        driver_ranks = [ranks[0] for ranks in layout]
        driver_group = groups.subgroup([driver_ranks], "data-parallel", device=False) if split > 1 else groups
        drivers = TensorParallel(driver_group) if groups.rank in driver_ranks else None
    if world.enable_expert_parallel:
        tp.expert_parallel = ExpertParallel(everyone, world.expert_dispatch)
    return ParallelGroups(tp, drivers, tp)
