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


def test_quiet_requests_get_one_delta_with_the_whole_output():
    from engine.engine_process import _deltas
    from engine.outputs import RequestOutput

    def out(rid, ids, text, new_ids, new_text, finished):
        return RequestOutput(rid, ids, text, new_ids, new_text, finished, "length" if finished else None, None, 5, 0, 0.01)

    quiet = {"q"}
    first = _deltas([out("s", [1], "a", [1], "a", False), out("q", [1], "a", [1], "a", False)], quiet)
    assert [(d.request_id, d.new_token_ids, d.new_text) for d in first] == [("s", [1], "a")]
    last = _deltas([out("s", [1, 2], "ab", [2], "b", True), out("q", [1, 2], "ab", [2], "b", True)], quiet)
    assert [(d.request_id, d.new_token_ids, d.new_text, d.finished, d.num_output_tokens) for d in last] == [
        ("s", [2], "b", True, 2), ("q", [1, 2], "ab", True, 2)]
    assert quiet == set()  # forgotten once finished
