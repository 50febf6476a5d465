"""The engine process's CPU thread count: one core is left to the gateway unless configured."""

import pytest
import torch

from engine.config import EngineConfig
from engine.engine_process import _serving_cpu_threads


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_serving_leaves_one_core_to_the_gateway(torch_threads):
    for cores, expected in ((4, 3), (2, 1), (1, 1)):
        torch.set_num_threads(cores)
        assert _serving_cpu_threads(EngineConfig(model="m", device="cpu")).cpu_threads == expected
    assert _serving_cpu_threads(EngineConfig(model="m", device="cpu", cpu_threads=2)).cpu_threads == 2


def test_cpu_threads_is_validated():
    with pytest.raises(ValueError):
        EngineConfig(model="m", cpu_threads=0)
    with pytest.raises(ValueError):
        EngineConfig(model="m", background_token_budget=0)
