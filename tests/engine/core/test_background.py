"""Background work (the Batch API's lines) yields step time to foreground work, by simulation.

The policy (``SchedulerConfig``): a step that prefills foreground work serves no
background work; while foreground work is present or was within
``background_window_s``, background work gets at most ``background_token_budget``
tokens a step; otherwise it has the whole step. Each test checks the scheduler's
output against these rules computed here from the requests' own state.
"""

import itertools
import random

import pytest

from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.request import Request, RequestStatus
from engine.core.request_policy import RequestPolicy
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler

_ids = itertools.count()


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make(clock: Clock, budget: int = 6, window_s: float = 1.0, max_num_seqs: int = 8, tokens: int = 64,
         num_blocks: int = 400, block_size: int = 4) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, tokens, 512, background_token_budget=budget, background_window_s=window_s)
    return Scheduler(config, CacheConfig(block_size, num_blocks, True), clock=clock)


def req(prompt_len=8, max_tokens=8, background=False, priority=None) -> Request:
    n = next(_ids)  # distinct prompts: no prefix-cache hits to blur the token counts
    policy = RequestPolicy(priority=(2 if background else 1) if priority is None else priority,
                           tenant="bulk" if background else "web", background=background)
    return Request(f"b{n}", [n * 1000 + i for i in range(prompt_len)], SamplingParams(ignore_eos=True), max_tokens,
                   policy=policy)


def step(sched: Scheduler):
    out = sched.schedule()
    sched.update(out, [7 if s.sample else None for s in out.scheduled])
    return out


def background_tokens(out) -> int:
    return sum(s.num_new_tokens for s in out.scheduled if s.request.policy.background)


def test_foreground_prefill_gets_the_step_to_itself_then_background_is_capped():
    clock = Clock()
    sched = make(clock, budget=5)
    bulk = [req(max_tokens=50, background=True) for _ in range(6)]
    for r in bulk:
        sched.add_request(r)
    first = step(sched)
    assert background_tokens(first) == 6 * 8  # no foreground yet: the whole step (6 prompts of 8)
    assert background_tokens(step(sched)) == 6  # six decodes
    live = req(prompt_len=10, max_tokens=3)
    sched.add_request(live)
    out = step(sched)
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(live, 10)]
    assert all(r.status == RequestStatus.RUNNING for r in bulk)  # they keep their blocks
    for _ in range(2):  # the live request decodes; the background shares the step within its budget
        out = step(sched)
        assert live in {s.request for s in out.scheduled} and background_tokens(out) == 5
    assert live.is_finished


def test_background_has_whole_steps_again_after_the_window():
    clock = Clock()
    sched = make(clock, budget=4, window_s=2.0)
    live = req(max_tokens=2)
    sched.add_request(live)
    step(sched)
    bulk = [req(prompt_len=20, max_tokens=40, background=True) for _ in range(6)]
    for r in bulk:
        sched.add_request(r)
    step(sched)
    assert live.is_finished
    clock.t += 1.9  # within the window: still capped
    assert sched.foreground_recent()
    assert background_tokens(step(sched)) == 4
    clock.t += 0.2  # past it
    assert not sched.foreground_recent()
    out = step(sched)
    assert background_tokens(out) == 64  # the whole token budget of the step


def test_caps_only_background_work():
    clock = Clock()
    sched = make(clock, budget=2)
    standard = [req(max_tokens=30) for _ in range(4)]
    for r in standard:
        sched.add_request(r)
    step(sched)
    realtime = req(prompt_len=6, max_tokens=5, priority=0)
    sched.add_request(realtime)
    out = step(sched)  # worse-ranked but not background: shares the step as before
    assert {s.request for s in out.scheduled} == set(standard) | {realtime}


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_follows_the_rules_and_everything_finishes(seed):
    rng = random.Random(seed)
    clock = Clock()
    budget, window = rng.randint(1, 12), rng.choice([0.0, 0.05, 0.3])
    sched = make(clock, budget=budget, window_s=window, max_num_seqs=rng.randint(2, 10),
                 tokens=rng.randint(16, 96), num_blocks=rng.randint(60, 200))
    everyone = []
    for _ in range(30):
        r = req(rng.randint(1, 30), rng.randint(1, 20), background=True)
        everyone.append(r)
        sched.add_request(r)
    last_foreground = -float("inf")
    for step_no in range(5000):
        if step_no < 600 and rng.random() < 0.08:
            r = req(rng.randint(1, 30), rng.randint(1, 10))
            everyone.append(r)
            sched.add_request(r)
        # The rules, from the requests' state before the step.
        foreground = [r for r in sched.requests.values() if not r.policy.background]
        if foreground:
            last_foreground = clock.t
        # What the engine process sizes its CPU threads by (engine.serving.serving_threads).
        assert sched.foreground_recent() == (bool(foreground) or clock.t - last_foreground <= window), step_no
        prefilling = any(r.num_tokens - r.num_computed_tokens > 1 or r.status != RequestStatus.RUNNING
                         for r in foreground)
        out = step(sched)
        if clock.t - last_foreground <= window:
            assert background_tokens(out) <= (0 if prefilling else budget), (step_no, out)
        elif not foreground:
            assert background_tokens(out) == out.num_batched_tokens
        clock.t += 0.01
        if not sched.has_unfinished():
            break
    assert all(r.is_finished for r in everyone), "background work starved"
