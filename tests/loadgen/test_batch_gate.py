"""Static and dynamic batching as gates in front of the continuous engine: batches form, run out, nobody joins one
in flight; a dynamic batch starts after its wait. A fake clock drives the gate; the engine is the real one."""

import pytest

from engine import LLM, SamplingParams
from loadgen.batch_gate import BatchGate


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    return LLM(model=demo_model_dir, max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=128,
               enable_prefix_caching=False, cpu_threads=1).engine


def _params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _running_ids(engine) -> set[str]:
    return {r.request_id for r in engine.scheduler.running}


def test_static_waits_for_a_full_batch_and_runs_it_out(engine):
    now = [0.0]
    gate = BatchGate(engine, "static", batch_size=4, max_wait_s=0.1, clock=lambda: now[0])
    for i, n in enumerate((2, 9, 5)):
        gate.submit([5 + i, 6, 7, 8], _params(n), f"a{i}")
    now[0] = 10.0
    assert gate.step() == [] and not engine.has_unfinished()  # 3 < batch size: static waits however long
    gate.submit([9, 9, 9, 9], _params(3), "a3")
    gate.step()
    first = {f"a{i}" for i in range(4)}
    assert _running_ids(engine) == first
    for i in range(4):
        gate.submit([1, 2, 3, 4 + i], _params(2), f"b{i}")
    while engine.has_unfinished():
        assert not _running_ids(engine) - first, "no joining a batch in flight"
        gate.step()
    gate.step()
    assert _running_ids(engine) == {f"b{i}" for i in range(4)}  # the next batch starts once the last finished
    while gate.has_unfinished():
        gate.step()


def test_dynamic_starts_a_partial_batch_after_its_wait_and_close_starts_the_rest(engine):
    now = [0.0]
    gate = BatchGate(engine, "dynamic", batch_size=4, max_wait_s=0.1, clock=lambda: now[0])
    gate.submit([5, 6, 7, 8], _params(3), "d0")
    now[0] = 0.05
    assert gate.step() == [] and not engine.has_unfinished()
    now[0] = 0.11
    gate.step()
    assert _running_ids(engine) == {"d0"}
    while engine.has_unfinished():
        gate.step()
    static = BatchGate(engine, "static", batch_size=4, clock=lambda: now[0])
    static.submit([5, 6, 7, 8], _params(3), "s0")
    static.close()  # nothing more will come: the partial batch may start
    static.step()
    assert _running_ids(engine) == {"s0"}
    while static.has_unfinished():
        static.step()


def test_continuous_passes_straight_through_and_bad_settings_are_refused(engine):
    gate = BatchGate(engine, "continuous", batch_size=2)
    gate.submit([5, 6, 7, 8], _params(2), "c0")
    assert engine.has_unfinished()
    while gate.has_unfinished():
        gate.step()
    with pytest.raises(ValueError, match="strategy"):
        BatchGate(engine, "eager", batch_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        BatchGate(engine, "static", batch_size=0)
