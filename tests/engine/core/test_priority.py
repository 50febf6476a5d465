"""Priorities, preemption policy, weighted fairness (VTC) and batching strategies, by simulation."""

import itertools
import random

import pytest

from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.request import Request, RequestStatus
from engine.core.request_policy import RequestPolicy
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from tests.engine.helpers import make_scheduler

_ids = itertools.count()


def req(prompt_len=8, max_tokens=8, arrival=None, **policy):
    return Request(f"q{next(_ids)}", [1] * prompt_len, SamplingParams(ignore_eos=True), max_tokens,
                   arrival_time=arrival, policy=RequestPolicy(**{"tenant": "t", **policy}))


def step(sched: Scheduler):
    out = sched.schedule()
    sched.update(out, [7 if s.sample else None for s in out.scheduled])
    return out


def scheduled_ids(out) -> set[str]:
    return {s.request.request_id for s in out.scheduled}


def test_weighted_fair_share_1_to_3():
    sched = make_scheduler(num_blocks=400, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    rng = random.Random()
    service = {"a": [], "b": []}  # per step, prompt tokens + 2 x output tokens (VTC's cost, unweighted)
    for _ in range(1500):
        for tenant, weight in (("a", 1.0), ("b", 3.0)):  # both always backlogged
            while sum(1 for r in sched.waiting if r.policy.tenant == tenant) < 3:
                sched.add_request(req(rng.randint(4, 30), rng.randint(4, 30), tenant=tenant, weight=weight))
        out = step(sched)
        for tenant in service:
            service[tenant].append(sum(
                s.num_new_tokens + (1 if s.sample else 0)  # a sampled token counts 2: 1 computed + 1 extra
                for s in out.scheduled if s.request.policy.tenant == tenant
            ))
    window = 300
    for start in range(200, 1500 - window + 1, 50):  # every window after warm-up
        a = sum(service["a"][start:start + window])
        b = sum(service["b"][start:start + window])
        assert abs(b / (a + b) - 0.75) <= 0.075, (start, a, b)


def test_idle_tenant_earns_no_credit():
    sched = make_scheduler(num_blocks=400, max_num_seqs=1, max_num_batched_tokens=64)
    for _ in range(10):
        sched.add_request(req(tenant="busy"))
    for _ in range(30):
        step(sched)
    assert sched.vtc.counters["busy"] > 0 and sched.has_unfinished()
    sched.add_request(req(tenant="late"))
    assert sched.vtc.counters["late"] == sched.vtc.counters["busy"]


def test_realtime_scheduled_within_one_step_of_a_full_engine():
    for full_by in ("seqs", "blocks"):
        sched = make_scheduler(num_blocks=12 if full_by == "blocks" else 400, block_size=4, max_num_seqs=3, max_num_batched_tokens=64)
        for priority in (1, 1, 2):
            sched.add_request(req(prompt_len=14, max_tokens=50, priority=priority))
        step(sched)
        step(sched)
        urgent = req(prompt_len=14, max_tokens=4, priority=0, preemptible=False)
        sched.add_request(urgent)
        out = step(sched)
        assert urgent.request_id in scheduled_ids(out), full_by
        assert out.preempted_ids, "a worse-ranked preemptible request made room"
        assert all(sched.requests[p].policy.priority > 0 for p in out.preempted_ids)


def test_equal_ranks_never_preempt_for_admission():
    sched = make_scheduler(num_blocks=400, max_num_seqs=2)
    first = [req(priority=1) for _ in range(2)]
    for r in first:
        sched.add_request(r)
    step(sched)
    late = req(priority=1)
    sched.add_request(late)
    out = step(sched)
    assert not out.preempted_ids and late.request_id not in scheduled_ids(out)


def test_non_preemptible_is_not_preempted_for_admission():
    sched = make_scheduler(num_blocks=400, max_num_seqs=1)
    batch = req(priority=2, preemptible=False, max_tokens=20)
    sched.add_request(batch)
    step(sched)
    standard = req(priority=1)
    sched.add_request(standard)
    out = step(sched)
    assert not out.preempted_ids and batch.status == RequestStatus.RUNNING


@pytest.mark.parametrize("full", ["seqs", "blocks"])
def test_a_class_without_may_preempt_waits_for_room(full):
    """A better rank whose class may not preempt waits; one whose class may, takes the place at once."""
    for may_preempt in (False, True):
        # Full by sequence count, or by KV blocks (a 26-token prompt and 2 output tokens fill 7 blocks of 4).
        sched = make_scheduler(num_blocks=400 if full == "seqs" else 7, max_num_seqs=1 if full == "seqs" else 8)
        running = req(prompt_len=8 if full == "seqs" else 26, priority=2, preemptible=True, max_tokens=2)
        sched.add_request(running)
        step(sched)
        urgent = req(priority=0, may_preempt=may_preempt)
        sched.add_request(urgent)
        out = step(sched)
        if may_preempt:
            assert out.preempted_ids == [running.request_id] and urgent.request_id in scheduled_ids(out)
        else:
            assert not out.preempted_ids and urgent.request_id not in scheduled_ids(out)
            assert running.num_preemptions == 0
            while not running.is_finished:
                step(sched)
            assert urgent.request_id in scheduled_ids(step(sched))  # served once the running one is done


@pytest.mark.parametrize("trial", range(3))
def test_batch_flood_delays_standard_by_at_most_one_step(trial):
    rng = random.Random()
    sched = make_scheduler(num_blocks=rng.randint(30, 80), block_size=4, max_num_seqs=rng.randint(2, 8),
                           max_num_batched_tokens=rng.randint(24, 64))
    for _ in range(40):
        sched.add_request(req(rng.randint(5, 40), rng.randint(5, 40), priority=2, tenant="batch"))
    for step_no in range(400):
        if step_no % 7 == 3:
            standard = req(rng.randint(2, 20), rng.randint(1, 10), priority=1, tenant="web")
            sched.add_request(standard)
            out = step(sched)
            assert standard.request_id in scheduled_ids(out), (trial, step_no)
        else:
            step(sched)
        if not sched.has_unfinished():
            break


def test_no_starvation_batch_finishes_under_steady_standard_load():
    rng = random.Random()
    sched = make_scheduler(num_blocks=200, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    batch_reqs = [req(20, 20, priority=2, tenant="batch") for _ in range(5)]
    for r in batch_reqs:
        sched.add_request(r)
    for step_no in range(2000):
        if step_no % 4 == 0:  # standard load that leaves some capacity idle
            sched.add_request(req(rng.randint(2, 8), rng.randint(2, 6), priority=1, tenant="web"))
        step(sched)
        if all(r.is_finished for r in batch_reqs):
            break
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in batch_reqs)


def test_preempted_request_keeps_its_place_in_its_rank():
    sched = make_scheduler(num_blocks=400, max_num_seqs=2, max_num_batched_tokens=64)
    victim = req(priority=2, max_tokens=30, arrival=1.0)
    other = req(priority=2, max_tokens=30, arrival=0.5)
    sched.add_request(other)
    sched.add_request(victim)
    step(sched)
    sched.add_request(req(priority=1, max_tokens=30, arrival=2.0))  # preempts `victim` (admitted last)
    out = step(sched)
    assert out.preempted_ids == [victim.request_id]
    later = req(priority=2, max_tokens=3, arrival=3.0)
    sched.add_request(later)
    assert sched.waiting.peek(2) is victim


def test_continuous_batching_admits_at_the_next_step():
    sched = make_scheduler(num_blocks=400, max_num_seqs=4, max_num_batched_tokens=64)
    a = req(max_tokens=20)
    sched.add_request(a)
    step(sched)
    b = req()
    sched.add_request(b)
    assert scheduled_ids(step(sched)) == {a.request_id, b.request_id}


def test_stats_record():
    sched = make_scheduler(num_blocks=50, block_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    for priority in (0, 1, 2, 2):
        sched.add_request(req(prompt_len=6, priority=priority))
    step(sched)
    stats = sched.stats()
    assert stats.num_running == 2 and stats.num_waiting_by_priority == {2: 2}
    assert stats.step_prefill_tokens == 12 and stats.step_decode_tokens == 0
    assert stats.kv_blocks_used == 4 and stats.kv_blocks_total == 50
    step(sched)
    assert sched.stats().step_decode_tokens == 2


def test_order_in_class_only_puts_a_request_behind_its_class():
    """vLLM's request priority as order_in_class: within a priority class, every waiting request with a smaller
    order starts first, whichever tenant's; a class still goes before any less urgent class whatever the orders."""
    rng = random.Random()
    sched = make_scheduler(num_blocks=400, max_num_seqs=1, max_num_batched_tokens=64)
    reqs = []
    for _ in range(24):
        r = req(rng.randint(2, 9), 2, priority=rng.choice([0, 1]), tenant=rng.choice("abc"),
                order_in_class=rng.choice([0, 0, 3, 7]))
        reqs.append(r)
        sched.add_request(r)
    started = []
    while sched.waiting or sched.running:
        for s in step(sched).scheduled:
            if s.request.request_id not in started:
                started.append(s.request.request_id)
    place = {rid: i for i, rid in enumerate(started)}
    assert len(place) == len(reqs)
    for x in reqs:
        for y in reqs:
            xp, yp = x.policy, y.policy
            if (xp.priority, xp.order_in_class) < (yp.priority, yp.order_in_class):
                assert place[x.request_id] < place[y.request_id], (xp, yp)
            if xp.tenant == yp.tenant and (xp.priority, xp.order_in_class) == (yp.priority, yp.order_in_class) and \
                    x.arrival_time < y.arrival_time:
                assert place[x.request_id] < place[y.request_id]  # a tenant's own requests keep arrival order
