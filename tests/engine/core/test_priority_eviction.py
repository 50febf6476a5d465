"""Eviction that knows priority class and tenant (``kv_eviction_policy``), against plain LRU side by side.

Every scenario is sized so that LRU must evict the protected prefix (asserted: the same run under ``lru`` loses
it), so the ``priority`` assertions cannot pass by the pool simply being large enough.
"""

import argparse
import random

import pytest

from engine import LLM, RequestPolicy, SamplingParams
from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.block import Block
from engine.core.free_queue import PriorityFreeQueue
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.engine_flags import add_engine_flags, engine_config
from engine.core.lru_index import Entry, LruIndex
from tests.engine.helpers import complete
from tests.hf_models import make_hf_model

BLOCK = 4
POOL = 24  # blocks: the realtime prompt's 16 and room for about one flood request beside them
PROMPT = 64  # the realtime tenant's system prompt: 16 blocks; a hit can cover 60 of its tokens (the last is computed)
REALTIME = RequestPolicy(priority=0, tenant="rt", cache_salt="rt")
BATCH = RequestPolicy(priority=2, tenant="batch", cache_salt="batch", background=True)


def _scheduler(policy: str) -> Scheduler:
    return Scheduler(SchedulerConfig(8, 256, 256), CacheConfig(BLOCK, POOL, True, eviction_policy=policy))


def _serve(scheduler: Scheduler, rid: str, prompt: list[int], policy: RequestPolicy, rng: random.Random) -> int:
    """Run one request (2 output tokens) alone to its end; its prefix-cache hit in tokens."""
    request = Request(rid, prompt, SamplingParams(ignore_eos=True), max_tokens=2, policy=policy)
    scheduler.add_request(request)
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        scheduler.update(out, [rng.randrange(1, 500) if s.sample else None for s in out.scheduled])
    return request.num_cached_tokens


def _flood_run(policy: str, system: list[int], floods: list[list[list[int]]], owners: list[RequestPolicy],
               protected: RequestPolicy) -> list[int]:
    """``protected``'s prompt ``system``, then each round of flood prompts (by ``owners``, in turn), then the
    prompt again: the hit of every repeat."""
    rng = random.Random(0)
    scheduler = _scheduler(policy)
    _serve(scheduler, "p0", system, protected, rng)
    hits = []
    for r, flood in enumerate(floods):
        for i, prompt in enumerate(flood):
            _serve(scheduler, f"f{r}.{i}", prompt, owners[i % len(owners)], rng)
        hits.append(_serve(scheduler, f"p{r + 1}", system, protected, rng))
    assert scheduler.kv.pool.num_evictions > 0
    scheduler.kv.pool.check_all_free()
    return hits


def test_background_flood_keeps_realtime_prompt_cached():
    rng = random.Random()
    system = [rng.randrange(1, 500) for _ in range(PROMPT)]
    # 5 distinct 22-token prompts a round (6 blocks each, 30 a round): more than the pool, so LRU loses it all.
    floods = [[[rng.randrange(1, 500) for _ in range(22)] for _ in range(5)] for _ in range(4)]
    kept = _flood_run("priority", system, floods, [BATCH], REALTIME)
    lost = _flood_run("lru", system, floods, [BATCH], REALTIME)
    assert all(hit >= 0.9 * PROMPT for hit in kept), kept
    assert all(hit < 0.9 * PROMPT for hit in lost), lost
    assert lost == [0] * len(floods), lost  # the flood is forced: LRU evicts every block of the prompt


def test_a_tenants_flood_evicts_its_own_blocks_first():
    rng = random.Random()
    quiet = RequestPolicy(priority=1, tenant="a-quiet", cache_salt="a-quiet")
    loud = RequestPolicy(priority=1, tenant="z-loud", cache_salt="z-loud")  # the same class: only the tenant differs
    system = [rng.randrange(1, 500) for _ in range(32)]  # 8 blocks
    floods = [[[rng.randrange(1, 500) for _ in range(18)] for _ in range(6)] for _ in range(3)]
    kept = _flood_run("priority", system, floods, [loud], quiet)
    lost = _flood_run("lru", system, floods, [loud], quiet)
    assert kept == [28] * len(floods), kept  # every full block but the one holding the last token
    assert lost == [0] * len(floods), lost


def test_priority_queue_order_and_revival():
    """Random pushes, revivals and pops against a reference by scan: uncached blocks first (oldest first), then
    the least urgent class, a tenant holding the most of its blocks (equally large tenants may go either way),
    that tenant's least recently freed."""
    rng = random.Random()
    queue = PriorityFreeQueue()
    reference: list[Block] = []  # queued blocks, least recently freed first
    for i in range(400):
        block = Block(i)
        if rng.random() < 0.8:
            block.block_hash = i.to_bytes(2, "little")
            block.tenant = rng.choice("abc")
            block.priority = rng.randrange(3)
        queue.push(block)
        reference.append(block)
        if rng.random() < 0.2:  # a prefix hit revives a queued block
            queue.remove(reference.pop(rng.randrange(len(reference))))
        if reference and rng.random() < 0.4:  # (the pool never pops an empty queue: it checks first)
            got = queue.pop()
            plain = [b for b in reference if b.block_hash is None]
            if plain:
                assert got is plain[0]
            else:
                worst = max(b.priority for b in reference)
                counts = {t: sum(b.priority == worst and b.tenant == t for b in reference) for t in "abc"}
                assert got.priority == worst and counts[got.tenant] == max(counts.values())
                assert got is next(b for b in reference if b.priority == worst and b.tenant == got.tenant)
            reference.remove(got)
        assert len(queue) == len(reference)


def test_tier_index_evicts_least_urgent_class_then_largest_tenant():
    classes = {"rt": 0, "a": 2, "b": 2}
    index = LruIndex(10, "priority", classes)
    lru = LruIndex(10, "lru", classes)
    for i, tenant in enumerate(["rt", "rt", "rt", "a", "a", "b", "b", "b", "b", "a"]):
        index.add(bytes([i]), Entry(tenant, 1, i))
        lru.add(bytes([i]), Entry(tenant, 1, i))
    index.get(bytes([5]))  # b's oldest becomes its most recent: b's order is 6 7 8 5
    index.get(bytes([6]), touch=False).pins = 1  # a load in progress: never a victim
    # class 2 first: b holds 4 (a 3), so b's LRU unpinned block, then the larger of a and b each time (ties: a);
    # b's pinned 6 ends its run, and only then the realtime class
    assert index.victims("rt", 5, None) == [bytes([i]) for i in (7, 3, 8, 4, 5)]
    assert index.victims("rt", 7, None) == [bytes([i]) for i in (7, 3, 8, 4, 5, 9, 0)]
    assert lru.victims("rt", 5, None) == [bytes([i]) for i in range(5)]  # LRU: the realtime blocks go first
    assert index.victims("rt", 10, None) is None  # one block is pinned
    for key in index.victims("a", 3, None):  # the index stays consistent through removals
        index.remove(key)
    assert len(index) == 7 and index.used == 7
    index.add(b"new", Entry("b", 3, 99))
    assert index.victims("rt", 1, None) == [bytes([5])]  # b holds 5 of class 2 now (6 pinned, 5 its oldest)


def test_flag_and_config_check():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_config(parser.parse_args([])).kv_eviction_policy == "priority"
    assert engine_config(parser.parse_args(["--kv-eviction-policy", "lru"])).kv_eviction_policy == "lru"
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--kv-eviction-policy", "fifo"])
    assert exit_info.value.code == 2
    with pytest.raises(ValueError, match="kv_eviction_policy"):
        EngineConfig(model="m", kv_eviction_policy="fifo")


def test_engine_keeps_realtime_prompt_and_tokens(tmp_path):
    """The scheduler scenario through a real engine on a tiny model: the realtime prompt stays cached beside a
    background flood, and every greedy token equals the cache-off run's."""
    rng = random.Random()
    make_hf_model("qwen2_moe", str(tmp_path), seed=rng.randrange(2**31))
    system = [rng.randrange(1, 200) for _ in range(PROMPT)]
    floods = [[[rng.randrange(1, 200) for _ in range(22)] for _ in range(5)] for _ in range(2)]
    work = [(system, REALTIME)]
    for flood in floods:
        work += [(prompt, BATCH) for prompt in flood] + [(system, REALTIME)]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    off = LLM(model=str(tmp_path), block_size=BLOCK, enable_prefix_caching=False, num_kv_blocks=256)
    expected = [complete(off.engine, prompt, params, policy).token_ids for prompt, policy in work]
    llm = LLM(model=str(tmp_path), block_size=BLOCK, num_kv_blocks=POOL, kv_eviction_policy="priority")
    got = [complete(llm.engine, prompt, params, policy) for prompt, policy in work]
    assert [o.token_ids for o in got] == expected
    repeats = [o.num_cached_tokens for (prompt, _), o in zip(work, got) if prompt is system][1:]
    assert all(hit >= 0.9 * PROMPT for hit in repeats), repeats
    assert llm.engine.scheduler.kv.pool.num_evictions > 0  # the flood did evict (its own blocks)
    llm.engine.scheduler.kv.pool.check_all_free()
