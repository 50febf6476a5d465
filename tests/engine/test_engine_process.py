"""The engine process: its CPU thread count (one core left to the gateway while foreground work is recent,
unless configured) and the deltas it sends."""

import random

import pytest

from engine.config import EngineConfig
from engine.serving_threads import ServingThreads


def test_serving_threads_leave_one_core_to_the_gateway_only_while_foreground_work_is_recent():
    rng = random.Random()
    for cores, fixed in ((4, None), (2, None), (1, None), (rng.randint(2, 16), None), (8, rng.randint(1, 8))):
        calls: list[int] = []
        threads = ServingThreads(EngineConfig(model="m", device="cpu", cpu_threads=fixed), cores, calls.append)
        expected_calls, current = [], None
        for _ in range(50):
            recent = rng.random() < 0.5
            threads.before_step(recent)
            # Independent reference: the configured count if any, else cores - 1 (at least 1) or every core.
            want = fixed if fixed is not None else (max(1, cores - 1) if recent else cores)
            if want != current:
                expected_calls.append(want)
                current = want
            assert threads.current == want
        assert calls == expected_calls  # set only when the count changes


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


def test_statistics_without_deltas_go_out_on_a_change_of_waiting_counts_when_idle_or_after_the_interval():
    from engine.engine_process import StatsReports
    from engine.stats import SchedulerStats

    rng = random.Random()
    clock = [rng.uniform(0, 1e6)]
    interval = rng.uniform(0.01, 0.2)
    reports = StatsReports(interval, clock=lambda: clock[0])

    def stats(waiting: dict[int, int]) -> SchedulerStats:
        return SchedulerStats(1, waiting, 0, 8, 0, 0, 0, 0, 0, 1, 0, 0)

    assert not reports.due(None, busy=True) and not reports.due(None, busy=False)
    last_at, last_waiting, sent = float("-inf"), None, 0
    for _ in range(400):
        clock[0] += rng.uniform(0, interval / 3)
        waiting = {2: rng.choice((3, 3, 3, 4))} if rng.random() < 0.9 else {}
        busy = rng.random() < 0.95
        s = stats(waiting)
        # Reference: the rule as the docstring states it, from the history kept here.
        want = not busy or waiting != last_waiting or clock[0] - last_at >= interval
        assert reports.due(s, busy) == want
        if want:
            reports.sent(s)
            last_at, last_waiting, sent = clock[0], waiting, sent + 1
    assert 0 < sent < 400  # some steps were quiet, some reported
