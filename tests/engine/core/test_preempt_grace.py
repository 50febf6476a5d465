"""A class's grace before preempting (``RequestPolicy.preempt_grace_ms``), by simulation on the scheduler's clock.

A waiting urgent request whose class has a grace takes a less urgent running request's place only once it has
waited that long: a slot freed within it (a running request ending) is taken without anyone losing progress;
without a grace (the field's default) it preempts at once, as before. (Sequence slots and KV blocks run out
through the same admission-preemption choice, ``Scheduler._admission_victim``; the slots are simulated here.)
"""

import random

import pytest

from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.request import RequestStatus
from engine.core.request_policy import RequestPolicy
from engine.core.scheduler import Scheduler
from tests.engine.core.test_starvation import STEP_S, Clock, req, step


def run(grace_ms: float | None, low_tokens: list[int], seed: int):
    """Two standard requests decoding (one ending after ``low_tokens[0]`` outputs, the other after
    ``low_tokens[1]``) fill the engine's 2 sequence slots; an urgent request arrives. Returns (the step it was
    admitted at, the preempted ids over the run, the standard requests)."""
    rng = random.Random(seed)
    clock = Clock()
    sched = Scheduler(SchedulerConfig(2, 64, 4096), CacheConfig(4, 1000, False), clock=clock)
    standard = RequestPolicy(priority=1, tenant="std")
    urgent = RequestPolicy(priority=0, tenant="rt", preempt_grace_ms=grace_ms)
    low = [req(rng, standard, 12, n) for n in low_tokens]
    for r in low:
        sched.add_request(r)
    for _ in range(3):
        step(sched, clock)
    assert all(r.status == RequestStatus.RUNNING and r.num_output_tokens > 0 for r in low)
    high = req(rng, urgent, prompt_len=rng.randrange(9, 13), max_tokens=2)
    sched.add_request(high)
    preempted, admitted_at = [], None
    for i in range(60):
        out = step(sched, clock)
        preempted += out.preempted_ids
        if admitted_at is None and high in {s.request for s in out.scheduled}:
            admitted_at = i
        if high.is_finished and all(r.is_finished for r in low):
            break
    assert high.is_finished and all(r.is_finished for r in low)
    return admitted_at, preempted, low


@pytest.mark.parametrize("seed", range(3))
def test_without_grace_the_urgent_request_preempts_at_once(seed):
    admitted_at, preempted, low = run(None, [20, 30], seed)
    assert admitted_at == 0
    assert preempted and preempted[0] in {r.request_id for r in low}


@pytest.mark.parametrize("seed", range(3))
def test_room_that_frees_within_the_grace_is_waited_for(seed):
    rng = random.Random(seed)
    ends = rng.randrange(5, 9)  # outputs of the standard request that ends first: a few steps after the arrival
    grace_steps = ends + 5
    admitted_at, preempted, low = run(grace_steps * STEP_S * 1e3, [ends, 40], seed)
    assert preempted == [], "nobody loses progress when room frees within the grace"
    assert 0 < admitted_at <= ends, "admitted at the step its room freed"
    assert all(r.num_preemptions == 0 for r in low)


@pytest.mark.parametrize("seed", range(3))
def test_past_the_grace_the_urgent_request_preempts(seed):
    grace_steps = 4 + seed
    admitted_at, preempted, low = run(grace_steps * STEP_S * 1e3, [40, 50], seed)
    assert preempted and preempted[0] in {r.request_id for r in low}
    assert grace_steps - 1 <= admitted_at <= grace_steps + 1
