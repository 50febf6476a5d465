"""The check every rank makes of the world before groups form (``engine.distributed.world.world_problem``): a
world laid out as the replicas say passes; each way one rank can be wrong is named."""

import dataclasses
import random

import pytest

from engine.distributed.world import ReplicaClaim, world_problem


def _world(rng: random.Random) -> list[ReplicaClaim | None]:
    """A random fitting world: D replicas of T ranks, each replica's engine process at rank d*T."""
    replicas, split = rng.randint(1, 4), rng.randint(1, 4)
    shared = dict(data_parallel_size=replicas, tensor_parallel_size=split, enable_expert_parallel=True,
                  expert_dispatch=rng.choice(["all_to_all", "all_gather"]), dtype=rng.choice(["torch.float32", "torch.bfloat16"]),
                  quantization=rng.choice([None, "fp8"]), model_shape=("Qwen3MoeForCausalLM", 64, 2, 97))
    return [ReplicaClaim(data_parallel_rank=r // split, **shared) if r % split == 0 else None
            for r in range(replicas * split)]


@pytest.mark.parametrize("case", range(5))
def test_a_fitting_world_passes_and_each_misfit_is_named(case):
    seed = random.randrange(2**31)  # drawn when the test runs: collected ids stay the same in every process
    rng = random.Random(seed)
    claims = _world(rng)
    assert world_problem(claims) is None, seed
    split = claims[0].tensor_parallel_size
    engines = [r for r, c in enumerate(claims) if c is not None]

    # A replica started with another setting every replica must share.
    r = rng.choice(engines)
    field, value = rng.choice([("expert_dispatch", "other"), ("dtype", "float16"), ("quantization", "int8"),
                               ("model_shape", ("MixtralForCausalLM", 64, 2, 97)), ("enable_expert_parallel", False),
                               ("random_weights", ("qwen3-30b-a3b:num_hidden_layers=2", 7)),
                               ("expert_balance", (4, 1000, 3000))])
    if r:
        wrong = list(claims)
        wrong[r] = dataclasses.replace(claims[r], **{field: value})
        assert field in world_problem(wrong) and f"replica {r // split}" in world_problem(wrong), seed
    # Two replicas claiming one place.
    if len(engines) > 1:
        wrong = list(claims)
        r = rng.choice(engines[1:])
        wrong[r] = dataclasses.replace(claims[r], data_parallel_rank=0)
        assert f"world rank {r}" in world_problem(wrong) and "data_parallel_rank 0" in world_problem(wrong), seed
    # An engine process where a follower belongs, and a follower where an engine process belongs.
    if split > 1:
        wrong = list(claims)
        wrong[1] = claims[0]
        assert "start it with moegate engine-rank" in world_problem(wrong), seed
    wrong = list(claims)
    r = rng.choice(engines)
    wrong[r] = None
    assert f"world rank {r} is a follower" in world_problem(wrong), seed
    # A world whose size is not D x T.
    assert "ranks met" in world_problem(claims + [None]), seed
