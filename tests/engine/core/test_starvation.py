"""No starvation: a request unserved for the starvation bound is promoted ahead of every class, by simulation.

Strict priority alone lets a steady stream of urgent work starve a preempted request of a less urgent class
forever, and the background caps let steady live traffic starve a running batch line: each test runs the same
workload without a bound (the request never comes back, which is the failure the bound exists for) and with one
(it is readmitted within the bound plus the time one running request takes to end, and finishes).
"""

import argparse
import itertools
import random

import pytest

from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.request import PROMOTED, Request, RequestStatus
from engine.core.request_policy import RequestPolicy
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler

_ids = itertools.count()
STEP_S = 0.01  # simulated seconds per step


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(clock: Clock, bound: float | None, max_num_seqs: int = 2, tokens: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, tokens, 4096, background_token_budget=4, background_window_s=1.0,
                             starvation_bound_s=bound)
    return Scheduler(config, CacheConfig(4, 2000, True), clock=clock)


def req(rng: random.Random, policy: RequestPolicy, prompt_len: int, max_tokens: int) -> Request:
    n = next(_ids)  # distinct prompts: no prefix-cache hits
    return Request(f"s{n}", [n * 10_000 + rng.randrange(5000) for _ in range(prompt_len)],
                   SamplingParams(ignore_eos=True), max_tokens, policy=policy)


def step(sched: Scheduler, clock: Clock):
    out = sched.schedule()
    sched.update(out, [7 if s.sample else None for s in out.scheduled])
    clock.t += STEP_S
    return out


REALTIME = RequestPolicy(priority=0, tenant="live", preemptible=False)
BATCH = RequestPolicy(priority=2, tenant="bulk")


def run_preempted_under_urgent_stream(bound: float | None, steps: int, seed: int):
    """A class-2 request preempted by a steady stream of class-0 requests that always keeps one waiting. Returns
    (the low request, when it was preempted, when it was next scheduled or None, the scheduler, realtime done)."""
    rng = random.Random(seed)
    clock = Clock()
    sched = make(clock, bound)
    low = req(rng, BATCH, prompt_len=rng.randrange(4, 12), max_tokens=rng.randrange(20, 40))
    sched.add_request(low)
    step(sched, clock)
    live: list[Request] = []
    preempted_at = readmitted_at = None
    for _ in range(steps):
        waiting_live = [r for r in live if r.status == RequestStatus.WAITING]
        while len(waiting_live) < 2:  # the urgent class never runs out of work
            r = req(rng, REALTIME, prompt_len=rng.randrange(3, 9), max_tokens=rng.randrange(3, 8))
            sched.add_request(r)
            live.append(r)
            waiting_live.append(r)
        out = step(sched, clock)
        if low.request_id in out.preempted_ids and preempted_at is None:
            preempted_at = clock.t - STEP_S
        elif preempted_at is not None and readmitted_at is None and low in {s.request for s in out.scheduled}:
            readmitted_at = clock.t - STEP_S
        if low.is_finished:
            break
    return low, preempted_at, readmitted_at, sched, sum(r.is_finished for r in live)


def test_a_preempted_request_is_readmitted_within_the_bound_under_a_steady_urgent_stream():
    seed = random.randrange(2**31)
    bound = 0.5
    # The longest a realtime request runs once admitted: its prompt (one step) and up to 7 decodes.
    one_request_s = 8 * STEP_S
    low, preempted_at, readmitted_at, sched, served = run_preempted_under_urgent_stream(bound, 400, seed)
    assert preempted_at is not None, f"seed={seed}: the urgent stream must preempt the batch request"
    assert readmitted_at is not None, f"seed={seed}: never readmitted"
    assert readmitted_at - preempted_at <= bound + one_request_s + STEP_S, (seed, readmitted_at - preempted_at)
    assert low.priority == PROMOTED and low.num_preemptions == 1, seed  # nothing preempted it once promoted
    assert low.is_finished and low.num_output_tokens == low.max_tokens, seed
    assert sched.num_promotions == 1 and sched.stats().num_promotions == 1
    assert served > 20, seed  # the urgent stream kept being served beside it

    # The same workload with no bound: the batch request never comes back while the stream lasts.
    low, preempted_at, readmitted_at, sched, _ = run_preempted_under_urgent_stream(None, 400, seed)
    assert preempted_at is not None and readmitted_at is None and not low.is_finished, seed
    assert sched.num_promotions == 0


def run_background_under_live_prefills(bound: float | None, steps: int, seed: int):
    """A running batch line while a live request arrives every step (so every step prefills live work and the
    background allowance is 0). Returns (the batch line, the step it got its last token or None)."""
    rng = random.Random(seed)
    clock = Clock()
    sched = make(clock, bound, max_num_seqs=64, tokens=256)
    line = req(rng, RequestPolicy(priority=3, tenant="batch", background=True), prompt_len=6,
               max_tokens=rng.randrange(10, 20))
    sched.add_request(line)
    step(sched, clock)  # alone: its prompt runs at once
    assert line.status == RequestStatus.RUNNING
    for i in range(steps):
        sched.add_request(req(rng, RequestPolicy(priority=1, tenant="web"), prompt_len=rng.randrange(3, 9),
                              max_tokens=2))
        step(sched, clock)
        if line.is_finished:
            return line, i
    return line, None


def test_a_running_background_request_finishes_under_steady_live_prefills():
    seed = random.randrange(2**31)
    bound = 0.3
    line, finished_step = run_background_under_live_prefills(bound, 200, seed)
    assert finished_step is not None, f"seed={seed}: the batch line never finished"
    # Starved for the bound, then one token a step (it needs max_tokens - 1 more after its prompt's).
    assert finished_step * STEP_S <= bound + (line.max_tokens + 2) * STEP_S, (seed, finished_step)
    line, finished_step = run_background_under_live_prefills(None, 200, seed)
    assert finished_step is None and line.num_output_tokens == 1, seed  # strict caps: starved while live work lasts


def test_the_bound_is_a_flag_that_takes_none_and_refuses_zero():
    from engine.engine_flags import add_engine_flags, engine_config

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_config(parser.parse_args([])).starvation_bound_s == EngineConfig(model="m").starvation_bound_s == 60
    assert engine_config(parser.parse_args(["--starvation-bound-seconds", "none"])).starvation_bound_s is None
    assert engine_config(parser.parse_args(["--starvation-bound-seconds", "2.5"])).starvation_bound_s == 2.5
    with pytest.raises(ValueError, match="starvation_bound_s must be > 0"):
        engine_config(parser.parse_args(["--starvation-bound-seconds", "0"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--starvation-bound-seconds", "soon"])
