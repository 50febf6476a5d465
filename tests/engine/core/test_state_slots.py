"""The state cache's slots: a running request holds exactly one, no two running requests share one, and their
number caps the running batch (admission waits, preemption gives the slot back) as max_num_seqs does."""

import random

from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.request import Request, RequestStatus
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from tests.engine.helpers import make_requests, run_to_completion


def test_slots_cap_the_running_batch_and_follow_preemption():
    rng = random.Random(random.randrange(2**31))
    # 3 slots for 8 requests, and a pool too small for all of them at once: both caps bite.
    scheduler = Scheduler(SchedulerConfig(8, 32, 256), CacheConfig(4, 24, False, num_state_slots=3))
    # The first two end at 60 tokens (15 blocks each, 30 together) and are admitted at once, so the pool runs out
    # before either finishes whatever the other lengths (random lengths alone missed a preemption 1 run in 17).
    longest = [Request(f"long{i}", [rng.randrange(50) for _ in range(30)], SamplingParams(ignore_eos=True),
                       max_tokens=30) for i in range(2)]
    for r in longest + make_requests(6, rng, prompt_len=(5, 40), max_tokens=(5, 30)):
        scheduler.add_request(r)
    peak = 0

    def check(out):
        nonlocal peak
        running = [r for r in scheduler.running if r.status == RequestStatus.RUNNING]
        peak = max(peak, len(running))
        assert len(running) <= 3
        held = {r.request_id: scheduler.states.slot(r.request_id) for r in running}
        assert len(set(held.values())) == len(held) and set(held.values()) <= {0, 1, 2}
        for s in out.scheduled:  # each part carries its request's slot
            assert s.state_slot == held[s.request.request_id]

    run_to_completion(scheduler, rng, on_step=check)
    assert peak == 3
    assert scheduler.num_preemptions > 0, "the small pool should have preempted"
    scheduler.states.check_all_free()
    scheduler.kv.pool.check_all_free()


def test_models_without_linear_layers_hold_no_slots():
    scheduler = Scheduler(SchedulerConfig(4, 32, 256), CacheConfig(4, 64, True))
    assert scheduler.states is None
    for r in make_requests(3, random.Random(0)):
        scheduler.add_request(r)
    out = scheduler.schedule()
    assert [s.state_slot for s in out.scheduled] == [-1, -1, -1]
