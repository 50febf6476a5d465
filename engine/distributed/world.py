"""How the ranks of an engine's world agree on what they form, before any group is made.

Every rank says what it is: each replica's engine process its ``ReplicaClaim``
(its place and the settings every replica must share), each follower rank
nothing. The claims are gathered on every rank, and every rank checks them the
same way (``world_problem``), so a world that does not fit together (a replica
started with another model, dtype or dispatch; an engine process where a
follower belongs; two replicas claiming one place) fails on every rank at once
with the same message, instead of leaving some ranks waiting on a group that
never forms.
"""

import dataclasses
from dataclasses import dataclass

from engine.core.config import EngineConfig
from engine.distributed.collectives import TensorParallel
from engine.distributed.groups import RankGroups
from engine.core.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class ReplicaClaim:
    """What a replica's engine process says about itself: its place among the replicas, and the settings
    that must be the same on every replica of the world (they shape the collectives every rank takes part in)."""

    data_parallel_rank: int
    data_parallel_size: int
    tensor_parallel_size: int
    enable_expert_parallel: bool
    expert_dispatch: str
    dtype: str
    quantization: str | None
    model_shape: tuple[str, int, int, int]  # architecture, hidden size, layers, vocabulary
    # (spec, seed) of a random-weight model, None for a checkpoint: replicas that divide the experts must draw
    # the same weights, or each would run experts of another model.
    random_weights: tuple[str, int] | None = None
    pipeline_parallel_size: int = 1
    # (spare slots, window, interval) of expert load balancing, None when off: replicas decide together.
    expert_balance: tuple[int, int, int] | None = None

    @classmethod
    def of(cls, config: EngineConfig, model_config: ModelConfig, dtype: str) -> "ReplicaClaim":
        """``dtype``: the one the engine resolved (``--dtype auto`` on one replica and the model's own dtype named
        on another agree)."""
        return cls(config.data_parallel_rank, config.data_parallel_size, config.tensor_parallel_size,
                   config.enable_expert_parallel, config.expert_dispatch, dtype, config.quantization,
                   (model_config.architecture, model_config.hidden_size, model_config.num_layers,
                    model_config.vocab_size),
                   (config.random_weights, config.seed) if config.random_weights else None,
                   config.pipeline_parallel_size,
                   (config.num_redundant_experts, config.eplb_window_steps, config.eplb_interval_steps)
                   if config.enable_eplb else None)

    def shared(self) -> dict:
        """The fields every replica must agree on."""
        fields = dataclasses.asdict(self)
        del fields["data_parallel_rank"]
        return fields


def world_problem(claims: list[ReplicaClaim | None]) -> str | None:
    """What is wrong with a world whose rank r said ``claims[r]`` (None: a follower rank), or None if it fits:
    replica d is ranks [dT, (d+1)T), its engine process at dT claiming data-parallel rank d, every replica
    with world rank 0's shared settings."""
    first = claims[0]
    if first is None:
        return "world rank 0 is a follower (moegate engine-rank); it must be replica 0's engine process"
    # A replica's ranks: its pipeline stages of tensor-parallel ranks, its engine process first.
    replicas, split = first.data_parallel_size, first.tensor_parallel_size * first.pipeline_parallel_size
    if len(claims) != replicas * split:
        return (f"{len(claims)} ranks met, but data_parallel_size x pipeline_parallel_size x tensor_parallel_size "
                f"is {replicas} x {first.pipeline_parallel_size} x {first.tensor_parallel_size} on world rank 0")
    for rank, claim in enumerate(claims):
        replica, place = divmod(rank, split)
        if place and claim is not None:
            return (f"world rank {rank} is an engine process (replica {claim.data_parallel_rank}), but it is "
                    f"rank {place} of replica {replica}: start it with moegate engine-rank")
        if not place and claim is None:
            return (f"world rank {rank} is a follower (moegate engine-rank), but it is replica {replica}'s engine "
                    "process: start that replica with moegate serve or moegate engine")
        if claim is None:
            continue
        if claim.data_parallel_rank != replica:
            return f"world rank {rank} is replica {replica}'s engine process, but it was given data_parallel_rank {claim.data_parallel_rank}"
        ours, theirs = claim.shared(), first.shared()
        for name in ours:
            if ours[name] != theirs[name]:
                return f"replica {replica} has {name}={ours[name]!r}, replica 0 {theirs[name]!r}: every replica needs the same"
    return None


def agree_on_world(groups: RankGroups, claim: ReplicaClaim | None) -> ReplicaClaim:
    """Gather every rank's claim (``claim``: this rank's, None for a follower) and check the world on every rank:
    world rank 0's claim if it fits, ValueError with the same message on every rank otherwise."""
    claims = TensorParallel(groups).all_gather_object(claim)
    problem = world_problem(claims)
    if problem:
        raise ValueError(problem)
    return claims[0]
