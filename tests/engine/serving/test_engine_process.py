"""The engine process: its CPU thread count (one core left to the gateway while foreground work is recent,
unless configured) and the deltas it sends."""

import random

import pytest

from engine.core.config import EngineConfig
from engine.serving.serving_threads import ServingThreads


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


def _output(rid, ids, text, new_ids, new_text, finished):
    """A step's output of ``rid``: ``new_ids``/``new_text`` new at this step, ``ids``/``text`` the whole so far."""
    from engine.core.outputs import RequestOutput

    return RequestOutput(rid, new_ids, new_text, finished, "length" if finished else None, 5, 0, len(ids), None, 0.01)


def _stats(waiting: dict[int, int]):
    from engine.core.stats import SchedulerStats

    return SchedulerStats(1, waiting, 0, 8, 0, 0, 0, 0, 0, 1, 0, 0)


def test_quiet_requests_get_one_delta_with_the_whole_output_and_background_ones_may_wait_for_company():
    from engine.serving.step_reports import StepReports

    clock = [100.0]
    reports = StepReports(0.05, clock=lambda: clock[0])
    reports.add("s", stream=True, background=False)
    reports.add("q", stream=False, background=False)  # a live non-streaming request
    for rid in ("b", "b2", "b3"):  # Batch API lines
        reports.add(rid, stream=False, background=True)
    busy = _stats({2: 5})
    first = reports.after_step([_output(r, [1], "a", [1], "a", False) for r in ("s", "q", "b", "b2", "b3")], busy, True)
    assert [(d.request_id, d.token_ids, d.text) for d in first.outputs] == [("s", [1], "a")]
    clock[0] += 0.01
    # "b" finishing alone waits (nothing urgent, the same ranks waiting, the interval not passed)...
    assert reports.after_step([_output("b", [1, 2], "ab", [2], "b", True)], busy, True) is None
    clock[0] += 0.01
    # ...and rides along when "q" finishes: it goes out at once, with its whole output.
    last = reports.after_step([_output("q", [1, 2], "ac", [2], "c", True)], busy, True)
    assert [(d.request_id, d.token_ids, d.text, d.finished, d.num_output_tokens) for d in last.outputs] == [
        ("q", [1, 2], "ac", True, 2), ("b", [1, 2], "ab", True, 2)]
    clock[0] += 0.01
    assert reports.after_step([_output("b2", [1, 3], "ad", [3], "d", True)], busy, True) is None
    clock[0] += 0.03
    assert reports.after_step([_output("b3", [1, 4], "ae", [4], "e", True)], busy, True) is None
    clock[0] += 0.02  # 0.05 s since the last message: the pending results go, with the statistics
    flushed = reports.after_step([], busy, True)
    assert [(d.request_id, d.token_ids, d.text) for d in flushed.outputs] == [("b2", [1, 3], "ad"),
                                                                                      ("b3", [1, 4], "ae")]
    assert flushed.stats is busy
    assert reports.quiet == {} and reports.deferrable == set()  # forgotten once finished


def test_a_pending_background_result_goes_out_when_nothing_waits_or_the_engine_falls_idle_and_not_after_abort():
    from engine.serving.step_reports import StepReports

    for end in ("dry", "idle", "abort"):
        clock = [5.0]
        reports = StepReports(10.0, clock=lambda: clock[0])  # the interval never passes here
        reports.add("w", stream=True, background=False)
        assert reports.after_step([_output("w", [1], "a", [1], "a", False)], _stats({2: 3}), True) is not None
        reports.add("b", stream=False, background=True)
        assert reports.after_step([_output("b", [4], "x", [4], "x", True)], _stats({2: 3}), True) is None
        if end == "dry":  # the engine has nothing waiting: the runner must hear now to refill it
            message = reports.after_step([], _stats({2: 0}), True)
        elif end == "idle":
            message = reports.after_step([], _stats({}), False)
        else:
            reports.forget("b")
            message = reports.after_step([], _stats({2: 3}), True)
            assert message is None
            continue
        assert [d.request_id for d in message.outputs] == ["b"]


def test_statistics_and_pending_results_follow_the_stated_rule():
    """Random steps against the rule as the module docstring states it, kept here from the history."""
    from engine.serving.step_reports import StepReports

    rng = random.Random()
    clock = [rng.uniform(0, 1e6)]
    interval = rng.uniform(0.01, 0.2)
    reports = StepReports(interval, clock=lambda: clock[0])
    last_at, last_ranks, pending, sent, next_id = float("-inf"), None, [], 0, 0
    for _ in range(600):
        clock[0] += rng.uniform(0, interval / 3)
        waiting = {r: rng.choice((0, 2, 3)) for r in rng.sample((0, 1, 2), rng.randint(0, 2))}
        busy = rng.random() < 0.95
        stats = _stats(waiting) if rng.random() < 0.97 else None
        outputs, urgent = [], []
        for _ in range(rng.randint(0, 2)):  # requests that finish at this step, each added just before
            rid, next_id = f"r{next_id}", next_id + 1
            stream, background = rng.random() < 0.3, rng.random() < 0.7
            reports.add(rid, stream, background)
            outputs.append(_output(rid, [1], "a", [1], "a", True))
            (pending if not stream and background else urgent).append(rid)
        ranks = frozenset(r for r, n in waiting.items() if n) if stats is not None else None
        want = (bool(urgent) or not busy or (stats is not None and ranks != last_ranks) or (pending and not ranks)
                or ((stats is not None or pending) and clock[0] - last_at >= interval))
        want = want and (stats is not None or urgent or pending)
        message = reports.after_step(outputs, stats, busy)
        assert (message is not None) == bool(want)
        if message is not None:
            assert [d.request_id for d in message.outputs] == urgent + pending
            assert message.stats is stats
            last_at, pending, sent = clock[0], [], sent + 1
            if stats is not None:
                last_ranks = ranks
    assert 0 < sent < 600  # some steps sent nothing, some did
