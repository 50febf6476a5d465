"""Prefix caching changes how much is computed, never what is generated."""

import random

import pytest

from engine import LLM, RequestPolicy, SamplingParams
from tests.hf_models import make_hf_model

BLOCK = 8
# 256 blocks of 8 hold every request of a test at once, and keep every block it caches (at most 19 requests of 69
# tokens): nothing is evicted or preempted unless a test asks for it with its own small pool, as with the pool sized
# from memory (2 GB, ~1.5 s to build per engine on the CPU).
ROOMY_POOL = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen2moe"))
    make_hf_model("qwen2_moe", path, seed=random.randrange(2**31))
    return path


def _greedy(max_tokens):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _prompts(rng: random.Random) -> list[list[int]]:
    system = [rng.randrange(1, 200) for _ in range(5 * BLOCK + 3)]  # ends mid-block
    prompts = [system + [rng.randrange(1, 200) for _ in range(rng.randint(1, 20))] for _ in range(5)]
    prompts.append(system[:2 * BLOCK + 5])  # a prefix of the others, ending mid-block
    prompts.append(system[:3 * BLOCK])  # a prefix ending exactly on a block boundary
    prompts.append(list(prompts[0]))  # an exact repeat
    return prompts


def _run_in_waves(llm: LLM, prompts, max_tokens=6):
    # Two waves so the second finds the first's blocks cached (within one wave they are computed together).
    first = llm.generate(prompts[:2], _greedy(max_tokens))
    return first + llm.generate(prompts[2:], _greedy(max_tokens))


def test_cache_on_equals_cache_off(model_dir):
    rng = random.Random()
    prompts = _prompts(rng)
    off = _run_in_waves(LLM(model=model_dir, block_size=BLOCK, enable_prefix_caching=False, num_kv_blocks=ROOMY_POOL),
                        prompts)
    llm = LLM(model=model_dir, block_size=BLOCK, num_kv_blocks=ROOMY_POOL)
    on = _run_in_waves(llm, prompts)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert all(o.num_cached_tokens == 0 for o in off)
    hits = [o.num_cached_tokens for o in on[2:]]
    assert all(h > 0 for h in hits), hits
    assert all(h % BLOCK == 0 and h < len(p) for h, p in zip(hits, prompts[2:]))
    assert on[-1].num_cached_tokens == (len(prompts[-1]) - 1) // BLOCK * BLOCK  # the repeat: all but the last token
    kv = llm.engine.scheduler.kv
    assert kv.prefix_hit_tokens == sum(o.num_cached_tokens for o in on) > 0
    kv.pool.check_all_free()


def test_cache_after_eviction(model_dir):
    rng = random.Random()
    prompts = _prompts(rng)
    fresh = [[rng.randrange(1, 200) for _ in range(60)] for _ in range(3)]
    off = LLM(model=model_dir, block_size=BLOCK, enable_prefix_caching=False, num_kv_blocks=ROOMY_POOL)
    expected = off.generate(prompts + fresh + prompts, _greedy(5))
    llm = LLM(model=model_dir, block_size=BLOCK, num_kv_blocks=24)  # too small to keep everything cached
    got = []
    for group in (prompts, fresh, prompts):
        for p in group:
            got.append(llm.generate([p], _greedy(5))[0])
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert llm.engine.scheduler.kv.pool.num_evictions > 0
    llm.engine.scheduler.kv.pool.check_all_free()


def test_salts_do_not_share(model_dir):
    rng = random.Random()
    prompt = [rng.randrange(1, 200) for _ in range(4 * BLOCK + 1)]
    llm = LLM(model=model_dir, block_size=BLOCK, num_kv_blocks=ROOMY_POOL)
    engine = llm.engine

    def run(salt):
        rid = engine.add_request(prompt, _greedy(3), policy=RequestPolicy(cache_salt=salt))
        whole = None
        while engine.has_unfinished():
            for o in engine.step():
                whole = o if whole is None else whole.merge(o)
        return whole

    a = run("tenant-a")
    b = run("tenant-b")
    a2 = run("tenant-a")
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0, "another tenant's blocks must not be reused"
    assert a2.num_cached_tokens == 4 * BLOCK
    assert a.token_ids == b.token_ids == a2.token_ids


def test_engine_stats_count_prefill_decode_and_expert_load(model_dir):
    llm = LLM(model=model_dir, block_size=BLOCK, num_kv_blocks=ROOMY_POOL)
    prompts = [[5] * 11, [6] * 3]
    llm.generate(prompts, _greedy(4))
    stats = llm.engine.stats()
    assert stats.total_prefill_tokens == 14 and stats.total_decode_tokens == 2 * 3  # first token comes with prefill
    # Every computed token is routed to top_k experts in each sparse layer (qwen2_moe test config: layer 0 only).
    top_k = llm.engine.model_config.cfg("num_experts_per_tok")
    assert [sum(layer) for layer in stats.expert_load] == [top_k * (14 + 6)]
    assert stats.num_running == 0 and stats.kv_blocks_used == 0


def test_shared_prefix_decode_attention_matches_plain_gather():
    """The shared-prefix decode path (shared blocks read once, merged by log-sum-exp) vs per-request SDPA."""
    import torch

    from engine.device_batch.attention_metadata import AttentionMetadata, DecodeGroup
    from engine.layers.paged_attention import paged_attention

    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    num_blocks, bs, kvh, d, h = 40, 4, 2, 8, 6
    k_cache, v_cache = torch.randn(num_blocks, bs, kvh, d), torch.randn(num_blocks, bs, kvh, d)
    shared = [3, 17, 9]
    tables = [shared + [20 + i, 30 + i][: 1 + i % 2] for i in range(5)]
    seq_lens = [len(t) * bs - (i % bs) for i, t in enumerate(tables)]  # last block partly filled
    q = torch.randn(len(tables), h, d)

    def meta(group):
        return AttentionMetadata(torch.zeros(0, dtype=torch.int64), len(tables), [group], [], [], [], [])

    width = max(len(t) for t in tables)
    full = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    lens = torch.tensor(seq_lens)[:, None]
    mask = (torch.arange(width * bs)[None, :] < lens)[:, None, None, :]
    ref = paged_attention(q, None, None, k_cache, v_cache, meta(DecodeGroup(0, 5, full, mask)), 0.3)

    own_w = width - len(shared)
    own = torch.tensor([t[3:] + [0] * (own_w - len(t) + 3) for t in tables])
    own_mask = ((len(shared) * bs + torch.arange(own_w * bs))[None, :] < lens)[:, None, None, :]
    got = paged_attention(q, None, None, k_cache, v_cache, meta(DecodeGroup(0, 5, own, own_mask, torch.tensor(shared))), 0.3)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), f"seed={seed}"


def test_adapters_do_not_share_blocks_and_never_collide_with_salts():
    """The adapter is its own typed part of every block hash: same prompt under two adapters (or under an adapter
    named like a tenant's salt) gets a different chain; same prompt, salt and adapter gets the same chain."""
    from engine.core.block_pool import hash_block_tokens
    from engine.core.kv_cache_manager import KVCacheManager
    from engine.core.request import Request

    rng = random.Random()
    prompt = [rng.randrange(1, 200) for _ in range(3 * BLOCK + 1)]
    manager = KVCacheManager(num_blocks=32, block_size=BLOCK, enable_caching=True)

    def admit(rid: str, policy: RequestPolicy) -> tuple[int, list[int]]:
        """Returns (cached blocks found, the request's block ids) after computing its whole prompt."""
        request = Request(rid, prompt, _greedy(1), 1, policy=policy)
        hits = manager.find_cached_prefix(request)
        assert manager.allocate_slots(request, len(prompt) - hits.num_blocks * BLOCK, hits)
        request.num_computed_tokens = len(prompt)
        manager.cache_computed_blocks(request)
        return hits.num_blocks, manager.block_ids(rid)

    first, blocks_a = admit("a", RequestPolicy(cache_salt="t", lora_adapter="ad-1"))
    second, blocks_b = admit("b", RequestPolicy(cache_salt="t", lora_adapter="ad-2"))
    base, blocks_c = admit("c", RequestPolicy(cache_salt="t"))
    again, blocks_d = admit("d", RequestPolicy(cache_salt="t", lora_adapter="ad-1"))
    assert (first, second, base) == (0, 0, 0), "another adapter's (or the base model's) blocks were reused"
    assert not set(blocks_a) & set(blocks_b) and not set(blocks_a) & set(blocks_c)
    assert again == 3 and blocks_d[:3] == blocks_a[:3], "the same adapter must hit its own prefix"
    # Typed parts: a salt never reproduces an adapter's hash, nor does moving bytes between the two.
    tokens = prompt[:BLOCK]
    assert hash_block_tokens(None, tokens, "x") != hash_block_tokens(None, tokens, None, "x")
    assert hash_block_tokens(None, tokens, "ab", "c") != hash_block_tokens(None, tokens, "a", "bc")
    assert hash_block_tokens(None, tokens, None) != hash_block_tokens(None, tokens, "")
    with pytest.raises(ValueError, match="lora_adapter"):
        RequestPolicy(lora_adapter="")
