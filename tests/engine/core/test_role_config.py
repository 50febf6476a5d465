"""A prefill or decode engine refuses what its connector cannot move yet, naming the field in one line."""

import random

import pytest

from engine.core.config import EngineConfig


@pytest.mark.parametrize("size", ["tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"])
def test_a_prefill_or_decode_engine_with_several_ranks_is_refused_naming_the_size(size):
    value = random.randint(2, 4)
    role = random.choice(["prefill", "decode"])
    # Data-parallel ranks of one engine divide the experts (the only data parallelism an engine has).
    extra = ({"enable_expert_parallel": True, "distributed_init_method": "tcp://127.0.0.1:29500"}
             if size == "data_parallel_size" else {})
    with pytest.raises(ValueError, match=f"role {role} .*{size} must be 1, got {value}$") as refused:
        EngineConfig(model="unused", role=role, **{size: value}, **extra)
    assert "\n" not in str(refused.value)
    EngineConfig(model="unused", role="both", **{size: value}, **extra)  # aggregated: accepted
