"""Prefix-cache tiers below the device pool (host memory, disk): they change where cached blocks come from,
never what is generated, and never cross tenants."""

import os
import random

import pytest
import torch

from engine import LLM, RequestPolicy, SamplingParams
from tests.hf_models import make_hf_model

BLOCK = 8
HOST_GB = 0.002  # a few hundred blocks of these tiny models: nothing is evicted from host unless a test asks


def _engine(**kwargs):
    """An engine kept alive by its LLM (an LLM closes its engine when collected)."""
    llm = LLM(**kwargs)
    llm.engine.llm = llm
    return llm.engine


def _greedy(max_tokens):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _run(engine, prompts, tenant="acme", max_tokens=5, share=None):
    """Run every prompt at once as ``tenant`` (its cache salt too); outputs in prompt order."""
    policy = RequestPolicy(tenant=tenant, cache_salt=tenant, cache_share=share)
    ids = [engine.add_request(p, _greedy(max_tokens), policy=policy) for p in prompts]
    whole = {}
    while engine.has_unfinished():
        for o in engine.step():
            whole[o.request_id] = o if o.request_id not in whole else whole[o.request_id].merge(o)
    return [whole[i] for i in ids]


def _tier(engine, tier, tenant, field):
    return sum(getattr(s, field) for s in engine.stats().cache_tiers if s.tier == tier and s.tenant == tenant)


def _check_capacity(engine):
    for index in [engine.tiers.host.index] + ([engine.tiers.disk.index] if engine.tiers.disk else []):
        assert index.used == sum(e.size for e in index.entries.values()) <= index.capacity


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family,overlap", [("qwen2_moe", False), ("mixtral", True), ("deepseek_v2", False),
                                            ("olmoe", False), ("gpt_oss", False),  # gpt-oss: a sliding cache group
                                            ("mimo_v2_flash", False)])  # layers of differing KV heads, V padded
def test_tiers_on_equals_off(tmp_path, family, overlap):
    """A pool too small for the workload: chunked prefill and preemption in every wave (asserted), evicted
    prefixes come back from the host tier, and every greedy token equals the engine without tiers."""
    tiers_on_equals_off(tmp_path, family, overlap, "cpu")


@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tiers_on_equals_off_cuda(tmp_path):
    """The same on CUDA: pinned host slots, saves on a side stream, loads before the forward, overlapped steps
    and CUDA graphs as the engine's CUDA defaults have them."""
    tiers_on_equals_off(tmp_path, "qwen3_moe", True, "cuda")


def tiers_on_equals_off(tmp_path, family: str, overlap: bool, device: str) -> None:
    torch.set_num_threads(1)
    seed = random.randrange(2**31)
    make_hf_model(family, str(tmp_path), seed=seed)
    rng = random.Random(seed)
    system = [rng.randrange(1, 200) for _ in range(3 * BLOCK + 2)]
    first = [system + [rng.randrange(1, 200) for _ in range(rng.randint(6, 20))] for _ in range(4)]
    fresh = [[rng.randrange(1, 200) for _ in range(40)] for _ in range(3)]
    settings = dict(model=str(tmp_path), block_size=BLOCK, num_kv_blocks=14, max_num_batched_tokens=24,
                    overlap_scheduling=overlap, device=device)
    assert max(len(p) for p in first) > settings["max_num_batched_tokens"]  # chunked prefill, by construction
    outs = {}
    for tiers in (False, True):
        engine = _engine(**settings, host_cache_gb=HOST_GB if tiers else 0.0)
        waves = [_run(engine, first), _run(engine, fresh), _run(engine, first)]
        outs[tiers] = [o.token_ids for wave in waves for o in wave]
        assert engine.scheduler.num_preemptions > 0, f"seed={seed}: the workload must preempt"
        if tiers:
            assert _tier(engine, "host", "acme", "hits") > 0, f"seed={seed}"
            # Every block of the repeated wave was computed before and the host tier holds what the pool
            # evicted: each prompt is served from cache but its last token (as an unlimited pool would).
            assert [o.num_cached_tokens for o in waves[2]] == [(len(p) - 1) // BLOCK * BLOCK for p in first], \
                f"seed={seed}"
            _check_capacity(engine)
            kv = engine.scheduler.kv
            if len(kv.windows) > 1:  # the sliding group's window blocks came back from the host tier too
                assert kv.tier_loads_by_group[1] > 0, f"seed={seed}: {kv.tier_loads_by_group}"
        engine.scheduler.kv.pool.check_all_free()
        engine.close()
    assert outs[True] == outs[False], f"seed={seed}"


@pytest.mark.timeout(600)
def test_host_disk_restart_tenants_layouts_and_corruption(tmp_path):
    """One workload through every tier: host after the pool was flushed, disk after a restart, never another
    tenant's blocks, never another model's or dtype's, never a corrupt file."""
    torch.set_num_threads(1)
    seed = random.randrange(2**31)
    model, other_model, disk = str(tmp_path / "m"), str(tmp_path / "m2"), str(tmp_path / "disk")
    make_hf_model("qwen3_moe", model, seed=seed)
    make_hf_model("qwen3_moe", other_model, seed=seed + 1)  # the same shapes, other weights
    rng = random.Random(seed)
    prompt = [rng.randrange(1, 200) for _ in range(5 * BLOCK + 3)]
    fillers = [[rng.randrange(1, 200) for _ in range(6 * BLOCK)] for _ in range(3)]
    full = (len(prompt) - 1) // BLOCK * BLOCK  # a full hit: every block but the one with the last token
    # lru: the fillers flush the pool whoever's blocks it holds (``priority`` would evict the fillers' own first)
    settings = dict(block_size=BLOCK, num_kv_blocks=16, host_cache_gb=HOST_GB, disk_cache_dir=disk,
                    disk_cache_gb=0.01, kv_eviction_policy="lru")
    reference = _run(_engine(model=model, block_size=BLOCK, num_kv_blocks=64), [prompt])[0].token_ids

    engine = _engine(model=model, **settings)
    assert _run(engine, [prompt])[0].num_cached_tokens == 0
    for filler in fillers:  # flush the device pool: every block of the prompt is evicted (to host)
        _run(engine, [filler], tenant="filler")
    assert not any(engine.scheduler.kv.pool.lookup(h) for h in engine.scheduler.kv._block_hashes(
        _probe(prompt, "acme"), len(prompt) // BLOCK))
    again = _run(engine, [prompt])[0]
    assert again.token_ids == reference and again.num_cached_tokens == full
    assert _tier(engine, "host", "acme", "hits") == full // BLOCK
    for filler in fillers:
        _run(engine, [filler], tenant="filler")
    stranger = _run(engine, [prompt], tenant="intruder")[0]
    assert stranger.token_ids == reference and stranger.num_cached_tokens == 0
    assert _tier(engine, "host", "intruder", "hits") == _tier(engine, "disk", "intruder", "hits") == 0
    _check_capacity(engine)
    engine.tiers.flush()
    engine.close()

    restarted = _engine(model=model, **settings)  # an empty pool and host tier: only the disk remembers
    assert _run(restarted, [prompt], tenant="intruder")[0].num_cached_tokens == 0
    assert _tier(restarted, "disk", "intruder", "hits") == 0
    # Its blocks are read from disk while it waits in its place: a request behind it in the same priority class
    # (a later order in the class) is admitted meanwhile, not held up behind it.
    ahead = restarted.add_request(prompt, _greedy(5), policy=RequestPolicy(tenant="acme", cache_salt="acme"))
    behind = restarted.add_request(fillers[0], _greedy(5), policy=RequestPolicy(
        tenant="other", cache_salt="other", order_in_class=1))
    whole = {}
    for o in restarted.step():
        whole[o.request_id] = o
    running = {r.request_id for r in restarted.scheduler.running}
    assert behind in running and ahead not in running
    while restarted.has_unfinished():
        for o in restarted.step():
            whole[o.request_id] = o if o.request_id not in whole else whole[o.request_id].merge(o)
    back = whole[ahead]
    assert back.token_ids == reference and back.num_cached_tokens == full
    assert _tier(restarted, "disk", "acme", "hits") == full // BLOCK
    _check_capacity(restarted)
    restarted.tiers.flush()
    restarted.close()

    for other in (dict(model=other_model), dict(model=model, dtype="bfloat16")):
        engine = _engine(**other, **settings)
        out = _run(engine, [prompt])[0]
        assert out.num_cached_tokens == 0, other
        assert _tier(engine, "disk", "acme", "hits") == 0 and _tier(engine, "host", "acme", "hits") == 0
        engine.close()

    files = sorted(n for n in os.listdir(disk) if n.endswith(".kvb"))
    assert files
    for i, name in enumerate(files):  # flip a payload byte in some, truncate the others
        path = os.path.join(disk, name)
        data = bytearray(open(path, "rb").read())
        if i % 2:
            data[-1] ^= 0xFF
        else:
            data = data[:len(data) - 7]
        open(path, "wb").write(bytes(data))
    engine = _engine(model=model, **settings)
    out = _run(engine, [prompt])[0]
    assert out.token_ids == reference and out.num_cached_tokens == 0
    assert engine.tiers.disk.num_deleted_corrupt >= 1 and _tier(engine, "disk", "acme", "hits") == 0
    engine.tiers.flush()
    engine.close()


def _probe(prompt, salt):
    from engine.core.request import Request

    return Request("probe", prompt, _greedy(1), 1, policy=RequestPolicy(cache_salt=salt))


@pytest.mark.timeout(300)
def test_router_index_counts_the_host_tier(tmp_path):
    """A router's prefix index sized from the engine's report still believes a replica holds a prefix the pool
    evicted to its host tier, and the engine does serve that prefix from cache."""
    from gateway.prefix_index import ReplicaBlocks, block_hashes, remembered_blocks

    torch.set_num_threads(1)
    seed = random.randrange(2**31)
    make_hf_model("olmoe", str(tmp_path), seed=seed)
    rng = random.Random(seed)
    engine = _engine(model=str(tmp_path), block_size=BLOCK, num_kv_blocks=16, host_cache_gb=HOST_GB)
    stats = engine.stats()
    assert stats.host_tier_blocks > 16
    pool_only, with_tiers = ReplicaBlocks(stats.kv_blocks_total), ReplicaBlocks(remembered_blocks(stats))
    prompts = [[rng.randrange(1, 200) for _ in range(6 * BLOCK + 1)] for _ in range(5)]  # 30 blocks > the pool
    for p in prompts:
        _run(engine, [p])
        for index in (pool_only, with_tiers):
            index.add(block_hashes(p, BLOCK, "acme"))
    first = block_hashes(prompts[0], BLOCK, "acme")
    assert pool_only.matched(first) == 0 and with_tiers.matched(first) == len(first)
    assert _run(engine, [prompts[0]])[0].num_cached_tokens == len(first) * BLOCK


@pytest.mark.timeout(300)
def test_tenant_over_its_share_evicts_only_its_own(tmp_path):
    """A tenant flooding the host tier with unique prompts under a 25% share leaves another tenant's evicted
    prefix in the host tier, and that tenant's repeat is still served from it."""
    torch.set_num_threads(1)
    seed = random.randrange(2**31)
    make_hf_model("qwen3_moe", str(tmp_path), seed=seed)
    rng = random.Random(seed)
    probe = _engine(model=str(tmp_path), block_size=BLOCK, num_kv_blocks=8, host_cache_gb=HOST_GB)
    slots = 24
    engine = _engine(model=str(tmp_path), block_size=BLOCK, num_kv_blocks=8,
                     host_cache_gb=slots * probe.tiers.block_bytes / 1e9)
    probe.close()
    assert engine.tiers.host.num_slots == slots
    calm = [rng.randrange(1, 200) for _ in range(4 * BLOCK + 1)]
    _run(engine, [calm], tenant="calm")
    for _ in range(8):  # 5 blocks each through an 8-block pool: everything is evicted to host
        _run(engine, [[rng.randrange(1, 200) for _ in range(5 * BLOCK + 1)]], tenant="flood", share=0.25)
        host = engine.tiers.host.index
        assert host.used_by_tenant.get("flood", 0) <= 0.25 * host.capacity and host.used <= host.capacity
    assert _tier(engine, "host", "flood", "evictions") > 0 and _tier(engine, "host", "calm", "evictions") == 0
    assert _run(engine, [calm], tenant="calm")[0].num_cached_tokens == 4 * BLOCK
    engine.close()


def test_tier_settings_are_checked():
    from engine.core.config import EngineConfig

    for bad, field in ((dict(host_cache_gb=-1), "host_cache_gb"), (dict(disk_cache_dir="/tmp/x"), "disk_cache_dir"),
                       (dict(disk_cache_dir="/tmp/x", disk_cache_gb=1), "host_cache_gb"),
                       (dict(host_cache_gb=1, enable_prefix_caching=False), "enable_prefix_caching"),
                       (dict(host_cache_gb=1, pipeline_parallel_size=2), "pipeline or data parallelism"),
                       (dict(host_cache_gb=1, disk_cache_dir="/tmp/x", disk_cache_gb=1, tensor_parallel_size=2),
                        "single-process")):
        with pytest.raises(ValueError, match=field):
            EngineConfig(model="m", **bad)


@pytest.mark.timeout(300)
def test_blocks_evicted_earlier_in_the_same_step_are_found_in_host(tmp_path):
    """Two requests admitted in one step: the first one's blocks evict the second one's cached prefix; the
    second still finds that prefix (in the host tier, saved before it is loaded), all of it."""
    torch.set_num_threads(1)
    seed = random.randrange(2**31)
    make_hf_model("mixtral", str(tmp_path), seed=seed)
    rng = random.Random(seed)
    engine = _engine(model=str(tmp_path), block_size=BLOCK, num_kv_blocks=30, max_num_batched_tokens=256,
                     host_cache_gb=HOST_GB)

    def tokens(n):
        return [rng.randrange(1, 200) for _ in range(n)]

    a = tokens(4 * BLOCK + 1)
    reference = _run(engine, [a], max_tokens=2)[0].token_ids  # 5 blocks: 4 cached, least recently freed
    _run(engine, [tokens(9 * BLOCK + 1)], max_tokens=2)  # 10 more, freed after a's
    # 15 fresh blocks are left; b needs 18: it evicts a's last blocks (the pool evicts a sequence's tail first)
    policy = RequestPolicy(tenant="acme", cache_salt="acme")
    b = engine.add_request(tokens(17 * BLOCK + 1), _greedy(1), policy=policy)
    again = engine.add_request(a, _greedy(2), policy=policy)
    plan = engine.scheduler.schedule()
    assert [s.request.request_id for s in plan.scheduled] == [b, again] and plan.tier_saves and plan.tier_loads
    assert engine.scheduler.requests[again].num_cached_tokens == 4 * BLOCK
    got = engine._run_synchronously(plan)
    while engine.has_unfinished():
        got += engine.step()
    out = [o for o in got if o.request_id == again]
    assert [t for o in out for t in o.token_ids] == reference, f"seed={seed}"
    engine.scheduler.kv.pool.check_all_free()


@pytest.mark.timeout(300)
def test_sliding_window_model_from_host_and_disk(tmp_path):
    """gpt-oss (a full and a sliding cache group): after the pool was flushed, and after a restart (disk only),
    the prompt is served whole from the tiers, the sliding group's window blocks coming back with the full
    group's, and generates the tokens of an engine that never evicted."""
    torch.set_num_threads(1)
    seed = random.randrange(2**31)
    model, disk = str(tmp_path / "m"), str(tmp_path / "disk")
    make_hf_model("gpt_oss", model, seed=seed)
    rng = random.Random(seed)
    prompt = [rng.randrange(1, 200) for _ in range(5 * BLOCK + 3)]
    fillers = [[rng.randrange(1, 200) for _ in range(6 * BLOCK)] for _ in range(3)]
    full = (len(prompt) - 1) // BLOCK * BLOCK
    # lru: the fillers flush the pool whoever's blocks it holds (``priority`` would evict the fillers' own first)
    settings = dict(block_size=BLOCK, num_kv_blocks=16, host_cache_gb=HOST_GB, disk_cache_dir=disk,
                    disk_cache_gb=0.01, kv_eviction_policy="lru")
    reference = _run(_engine(model=model, block_size=BLOCK, num_kv_blocks=64), [prompt])[0].token_ids
    for restart in (False, True):
        engine = _engine(model=model, **settings)
        if not restart:
            _run(engine, [prompt])
            for filler in fillers:
                _run(engine, [filler], tenant="filler")
        out = _run(engine, [prompt])[0]
        assert out.token_ids == reference and out.num_cached_tokens == full, f"restart={restart} seed={seed}"
        assert engine.scheduler.kv.tier_loads_by_group[1] > 0, f"restart={restart} seed={seed}"
        if restart:
            assert _tier(engine, "disk", "acme", "hits") > full // BLOCK  # the window's sliding blocks too
        engine.tiers.flush()
        engine.close()
