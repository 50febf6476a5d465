"""The host prefix-cache tier under tensor parallelism: each rank keeps its slice of every block in the same host
slots as rank 0, whose tier index decides; a prompt whose blocks left the device pool is served from the host
tier on both ranks and generates exactly the single process's tokens (gloo, 1 thread per process)."""

import random

import pytest

from tests.distributed.ranks import run_ranks
from tests.hf_models import make_hf_model

BLOCK = 8
# lru: the fillers push the prompt out of the pool whoever's blocks they are (``priority`` evicts their own first)
SETTINGS = dict(device="cpu", cpu_threads=1, block_size=BLOCK, num_kv_blocks=16, host_cache_gb=0.002,
                kv_eviction_policy="lru")


def _flush_and_repeat(rank: int, world: int, address: str, model_dir: str, prompt, fillers) -> dict:
    """Per mode: the prompt's tokens and cached tokens the second time (after fillers evicted it from the pool),
    and the host tier's hits."""
    from engine import LLM, RequestPolicy, SamplingParams
    from tests.engine.helpers import complete

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run(engine, tokens, tenant="acme"):
        return complete(engine, tokens, params, RequestPolicy(tenant=tenant, cache_salt=tenant))

    out = {}
    for name, extra in (("reference", dict(host_cache_gb=0, num_kv_blocks=64)), ("single", {}),
                        ("tp", dict(tensor_parallel_size=2))):
        llm = LLM(model_dir, **{**SETTINGS, **extra})
        try:
            first = run(llm.engine, prompt)
            for i, filler in enumerate(fillers):  # other tenants' prompts push the prompt's blocks out of the pool
                run(llm.engine, filler, tenant=f"f{i}")
            again = run(llm.engine, prompt)
            stats = llm.engine.stats()
            host_hits = sum(s.hits for s in stats.cache_tiers if s.tier == "host") if stats.cache_tiers else 0
            out[name] = (first.token_ids, again.token_ids, again.num_cached_tokens, host_hits)
        finally:
            llm.engine.close()
    return out


@pytest.mark.timeout(300)
def test_host_tier_under_tensor_parallelism(tmp_path):
    seed = random.randrange(2**31)
    make_hf_model("qwen3_moe", str(tmp_path), seed=seed)
    rng = random.Random(seed)
    prompt = [rng.randrange(1, 200) for _ in range(5 * BLOCK + 3)]
    fillers = [[rng.randrange(1, 200) for _ in range(6 * BLOCK)] for _ in range(3)]
    status, value = run_ranks(_flush_and_repeat, 1, str(tmp_path), prompt, fillers, timeout_s=240)[0]
    assert status == "ok", f"seed={seed}: {value}"
    reference, single, tp = value["reference"], value["single"], value["tp"]
    full = (len(prompt) - 1) // BLOCK * BLOCK  # every block but the one with the last token
    assert reference[0] == reference[1], f"seed={seed}"
    assert single[:3] == tp[:3] == (reference[0], reference[0], full), f"seed={seed}: single {single}, tp {tp}"
    assert single[3] == tp[3] == full // BLOCK, f"host hits, seed={seed}"
