"""A sliding-window cache group by simulation: the window's blocks are always there, the rest go back to the pool.

Plain Python (no torch, no model): the scheduler and KV cache manager with two cache groups, driven with random
tokens. The model-level check (greedy tokens identical to transformers with gpt-oss's sliding layers on their
own tables) is ``tests/engine/models/test_vs_transformers.py -k gpt_oss``.
"""

import random

import pytest

from engine.core.kv_cache_manager import first_live_block, sliding_blocks_bound
from tests.engine.helpers import make_requests, make_scheduler, run_to_completion


@pytest.mark.parametrize("trial", range(4))
def test_window_blocks_present_and_the_rest_released(trial):
    """Every step, each scheduled request's sliding table has a real block for every position its queries can see
    (keys after ``position - window``, by the attention rule itself) and the null block before
    ``first_live_block``; no block is in two groups at once; a request's sliding blocks stay within the bound.
    Prefix hits (shared prompt prefixes), chunked prefill and preemption (a small pool) all happen."""
    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    bs, window = 4, rng.choice([4, 6, 8, 13])
    chunk = rng.randint(8, 24)
    sched = make_scheduler(num_blocks=rng.randint(40, 60), block_size=bs, max_num_seqs=6, max_num_batched_tokens=chunk,
                           sliding_window=window)
    null = sched.kv.null_block_id
    shared = [rng.randrange(50) for _ in range(24)]
    reqs = make_requests(14, rng, prompt_len=(10, 90), max_tokens=(4, 30))
    # Two long requests one after the other, each decoding 30 tokens: the second's prompt fills while the first
    # still holds about 30 full-attention blocks, more than the pool holds for both, so a preemption is forced
    # whatever the other random lengths (short ones let every seed finish without one).
    reqs[6:6] = make_requests(2, rng, prompt_len=(100, 100), max_tokens=(30, 30))
    for i, r in enumerate(reqs):
        r.request_id = f"r{i}"
    for r in reqs[:5]:  # these share a 24-token prefix
        r.all_token_ids[:0] = shared
        r.prompt_token_ids = list(r.all_token_ids)
    for r in reqs:
        sched.add_request(r)
    preempted = []

    def check(out):
        preempted.extend(out.preempted_ids)
        live = {0: set(), 1: set()}
        for r in sched.running:
            full, sliding = sched.kv.block_ids(r.request_id), sched.kv.window_block_ids(r.request_id)
            live[0].update(full)
            live[1].update(b for b in sliding if b != null)
            assert sched.kv.blocks_held(r.request_id) == [len(full), sum(b != null for b in sliding)], seed
        assert not live[0] & live[1], f"seed={seed}: a block held in both groups"
        for s in out.scheduled:
            full, sliding = s.block_ids, s.window_block_ids
            assert len(sliding) == len(full), seed
            first_query, end = s.start, s.start + s.num_new_tokens
            for pos in range(max(0, first_query - window + 1), end):  # keys the step's queries can see
                assert sliding[pos // bs] != null, f"seed={seed}: position {pos} in the window has no block"
            first = first_live_block(s.start, window, bs)
            assert all(b == null for b in sliding[:first]), f"seed={seed}: a block the window passed is held"
            assert len(sliding) - first <= sliding_blocks_bound(window, bs, s.num_new_tokens), seed

    run_to_completion(sched, rng, on_step=check)
    full_peak, sliding_peak = sched.stats().kv_peak_request_blocks
    assert sliding_peak <= sliding_blocks_bound(window, bs, chunk) < full_peak, seed
    assert sched.kv.prefix_hit_tokens > 0, f"seed={seed}: no prefix hit"
    assert preempted, f"seed={seed}: the small pool should have preempted"
    for r in reqs:
        assert r.num_output_tokens == r.max_tokens, seed
    sched.kv.pool.check_all_free()


def _peak_tokens(sliding_window: int | None, num_blocks: int) -> tuple[int, int, int]:
    """Most computed tokens resident at once, most requests running at once, and preemptions, for 12 requests
    of 120 + 40 tokens."""
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_seqs=12, max_num_batched_tokens=32,
                           caching=False, sliding_window=sliding_window)
    for r in make_requests(12, rng, prompt_len=(120, 120), max_tokens=(40, 40)):
        sched.add_request(r)
    tokens, running = [], []

    def record(out):
        tokens.append(sum(r.num_computed_tokens + s.num_new_tokens for s in out.scheduled for r in [s.request]))
        running.append(len(sched.running))

    run_to_completion(sched, rng, on_step=record)
    sched.kv.pool.check_all_free()
    return max(tokens), max(running), sched.num_preemptions


def test_more_long_requests_fit_in_the_same_memory():
    """The same bytes: 120 blocks of both layers' K/V with one group, or 240 blocks of one layer's with the
    sliding layer (window 16) in a group of its own. Half the layers keep at most a window's blocks, so nearly
    twice as many tokens are resident at once, more requests run together and fewer are preempted."""
    one_tokens, one_running, one_preempted = _peak_tokens(None, 120)
    two_tokens, two_running, two_preempted = _peak_tokens(16, 240)
    assert one_tokens <= 120 * 4  # every resident token holds its slot in every layer
    assert two_tokens >= 1.6 * one_tokens, (one_tokens, two_tokens)
    assert two_running > one_running and two_preempted < one_preempted


def _brute_force_hit(manager, request, window: int) -> int:
    """The longest n whose n full blocks and whose window's blocks before position n * block_size are all
    cached, by trying every n (the reference for the manager's search)."""
    bs = manager.block_size
    hashes = manager._block_hashes(request, (request.num_tokens - 1) // bs)
    best = 0
    for n in range(len(hashes) + 1):
        if any(manager.pool.lookup(h) is None for h in hashes[:n]):
            break
        first = max(0, (n * bs - window) // bs)
        if all(manager.pool.lookup(bytes([1]) + h) is not None for h in hashes[first:n]):
            best = n
    return best


@pytest.mark.parametrize("trial", range(4))
def test_prefix_hit_needs_only_the_window_before_it(trial):
    """A request computes a 64-token prompt and ends; some of its cached blocks are then evicted (least recently
    used first, or at random). A request with the same prompt and more hits the longest prefix whose full
    blocks are cached and whose sliding group still holds the window before it, as trying every length says."""
    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    window, bs = rng.choice([(8, 4), (6, 4), (13, 4)])
    sched = make_scheduler(num_blocks=48, block_size=bs, max_num_batched_tokens=16, sliding_window=window)
    manager = sched.kv
    prompt = [rng.randrange(50) for _ in range(64)]
    first = make_requests(1, rng, prompt_len=(1, 1), max_tokens=(3, 3))[0]
    first.all_token_ids[:] = first.prompt_token_ids = list(prompt)
    sched.add_request(first)
    run_to_completion(sched, rng)
    # Evict some cached blocks: by handing them out (fresh blocks go first, then the least recently freed), or
    # at random (as a pool shared with other prompts would over time: hits then end anywhere).
    taken = []
    if trial % 2:
        for block in [b for b in manager.pool._cached.values() if rng.random() < 0.15]:
            del manager.pool._cached[block.block_hash]  # what BlockPool.allocate does to a cached block it reuses
            block.block_hash = None
    else:
        taken = manager.pool.allocate(rng.randint(0, manager.num_free_blocks))
    again = make_requests(1, rng, prompt_len=(1, 1), max_tokens=(1, 1))[0]
    again.request_id = "again"
    again.all_token_ids[:] = again.prompt_token_ids = prompt + [1, 2, 3]
    hit = manager.find_cached_prefix(again)
    assert hit.num_blocks == _brute_force_hit(manager, again, window), seed
    live = first_live_block(hit.num_blocks * bs, window, bs)
    assert all(b is not None for b in hit.groups[1][live:]) and all(b is None for b in hit.groups[1][:live]), seed
    assert len(hit.groups[0]) == len(hit.groups[1]) == hit.num_blocks, seed
    manager.pool.release(taken)
    assert manager.allocate_slots(again, again.num_tokens - hit.num_blocks * bs, hit), seed
    again.num_computed_tokens = hit.num_blocks * bs
    manager.free(again)
    manager.pool.check_all_free()
