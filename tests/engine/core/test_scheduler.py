"""The scheduler and block pool by simulation: budgets, chunking, preemption, accounting."""

import random
import subprocess
import sys

import pytest

from engine.core.block_pool import BlockPool
from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.request import RequestStatus
from engine.core.scheduler import Scheduler
from tests.engine.helpers import make_requests, make_scheduler, run_to_completion


def test_scheduler_imports_without_torch():
    code = "import sys, engine.core.scheduler, engine.core.block_pool; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("trial", range(6))
def test_random_workload_respects_budgets_and_frees_everything(trial):
    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    num_blocks = rng.randint(12, 40)
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_seqs=rng.randint(1, 6),
                           max_num_batched_tokens=rng.randint(1, 48), caching=rng.random() < 0.5)
    reqs = make_requests(rng.randint(5, 25), rng, prompt_len=(1, 30), max_tokens=(1, 16))
    for r in reqs:
        sched.add_request(r)

    def check(out):
        total = sum(s.num_new_tokens for s in out.scheduled)
        assert total == out.num_batched_tokens <= sched.config.max_num_batched_tokens, seed
        assert len(sched.running) <= sched.config.max_num_seqs, seed
        ids = [s.request.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids)), seed
        for s in out.scheduled:
            blocks = sched.kv.block_ids(s.request.request_id)
            need = -(-(s.request.num_computed_tokens + s.num_new_tokens) // 4)
            assert len(blocks) >= need, seed
        held = sum(len(sched.kv.block_ids(r.request_id)) for r in sched.running)
        assert held <= num_blocks

    run_to_completion(sched, rng, on_step=check)
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == r.max_tokens, seed
    sched.kv.pool.check_all_free()


def test_chunked_prefill_mixes_with_decodes():
    rng = random.Random(0)
    sched = make_scheduler(max_num_batched_tokens=8, block_size=4)
    short, long = make_requests(2, rng, prompt_len=(3, 3), max_tokens=(5, 5))
    long.all_token_ids = long.prompt_token_ids = [1] * 30
    sched.add_request(short)
    sched.add_request(long)
    out = sched.schedule()
    assert [(s.request, s.num_new_tokens, s.sample) for s in out.scheduled] == [(short, 3, True), (long, 5, False)]
    sched.update(out, [7, None])
    out = sched.schedule()  # decode of `short` plus the next chunk of `long`, in one step
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(short, 1), (long, 7)]


def test_preemption_is_recompute_and_resumes():
    rng = random.Random(1)
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64, caching=False)
    a, b = make_requests(2, rng, prompt_len=(8, 8), max_tokens=(12, 12))
    sched.add_request(a)
    sched.add_request(b)
    preempted = []
    run_to_completion(sched, rng, on_step=lambda out: preempted.extend(out.preempted_ids))
    assert preempted == ["r1"] * len(preempted) and preempted, "the later request is the victim"
    assert b.num_preemptions >= 1 and b.num_output_tokens == 12
    sched.kv.pool.check_all_free()


def test_abort_frees_blocks_anywhere():
    rng = random.Random(2)
    sched = make_scheduler(max_num_seqs=2)
    reqs = make_requests(4, rng, prompt_len=(10, 20), max_tokens=(30, 30))
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    sched.update(out, [1 if s.sample else None for s in out.scheduled])
    sched.abort("r0")  # running
    sched.abort("r3")  # waiting
    sched.abort("nope")  # unknown: ignored
    assert reqs[0].status == reqs[3].status == RequestStatus.FINISHED_ABORTED
    out = sched.schedule()
    assert {"r0", "r3"} <= set(out.finished_ids)
    run_to_completion(sched, rng)
    sched.kv.pool.check_all_free()


def test_abort_between_schedule_and_update():
    rng = random.Random(3)
    sched = make_scheduler()
    (r,) = make_requests(1, rng)
    sched.add_request(r)
    out = sched.schedule()
    sched.abort(r.request_id)
    assert sched.update(out, [5]) == []
    sched.kv.pool.check_all_free()


def test_block_pool_lru_and_double_free():
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.allocate(2)
    pool.register(a, b"h" * 16)
    pool.release([b, a])
    assert pool.num_free_blocks == 3
    assert pool.lookup(b"h" * 16) is a
    pool.allocate(2)  # takes the never-used block and b (LRU order) before a
    assert pool.lookup(b"h" * 16) is a
    pool.allocate(1)  # now a is reused: its hash is gone
    assert pool.lookup(b"h" * 16) is None and pool.num_evictions == 1
    with pytest.raises(AssertionError):
        pool.release([b, b])


@pytest.mark.parametrize("trial", range(3))
def test_prefill_chunk_cap_bounds_every_prompt_chunk_not_decodes(trial):
    """A decode engine's cap on one request's prompt tokens a step: every chunk of more than one token stays under
    it, decodes still run every step, and every request ends with its blocks freed."""
    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    cap = rng.randint(2, 9)
    sched = Scheduler(SchedulerConfig(8, 32, 256, prefill_chunk_tokens=cap), CacheConfig(4, 64, True, None))
    reqs = make_requests(rng.randint(3, 10), rng, prompt_len=(1, 40), max_tokens=(1, 12))
    for r in reqs:
        sched.add_request(r)
    chunks: list[int] = []

    def check(out):
        for s in out.scheduled:
            assert s.num_new_tokens <= cap, seed
            chunks.append(s.num_new_tokens)

    run_to_completion(sched, rng, on_step=check)
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == r.max_tokens, seed
    if any(len(r.prompt_token_ids) > cap for r in reqs):
        assert cap in chunks, seed  # a long prompt took the whole cap, not less
    sched.kv.pool.check_all_free()


@pytest.mark.parametrize("trial", range(3))
def test_prefill_chunk_cap_a_lone_last_prompt_token_counts_as_decode(trial):
    """A prompt computed alone in capped chunks: chunks of the cap from its first token, and when it is one token
    past a chunk boundary its last token is a one-token part that samples, which the statistics count as decode
    (the runner computes every one-token part on the decode path), the rest as prefill. The prompt lengths are
    forced to both sides of that boundary."""
    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    cap = rng.randint(2, 9)
    one_past, inside = cap * rng.randint(1, 5) + 1, cap * rng.randint(1, 5) + rng.randint(2, cap)
    for prompt_len, lone in ((one_past, True), (inside, False)):
        max_tokens = rng.randint(1, 6)
        sched = Scheduler(SchedulerConfig(4, 64, 256, prefill_chunk_tokens=cap), CacheConfig(4, 64, True, None))
        (req,) = make_requests(1, rng, prompt_len=(prompt_len, prompt_len), max_tokens=(max_tokens, max_tokens))
        sched.add_request(req)
        parts: list[int] = []
        run_to_completion(sched, rng, on_step=lambda out: parts.extend(s.num_new_tokens for s in out.scheduled))
        # Reference: the prompt cut into chunks of the cap (the last one shorter), then one token a step.
        whole, rest = divmod(prompt_len, cap)
        expected_parts = [cap] * whole + ([rest] if rest else []) + [1] * (max_tokens - 1)
        assert parts == expected_parts, (seed, cap, prompt_len)
        assert (expected_parts[len(expected_parts) - max_tokens] == 1) == lone  # the part that samples first
        assert sched.total_prefill_tokens == prompt_len - lone, (seed, cap, prompt_len)
        assert sched.total_decode_tokens == max_tokens - 1 + lone, (seed, cap, prompt_len)
        sched.kv.pool.check_all_free()
