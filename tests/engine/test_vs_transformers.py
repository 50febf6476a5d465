"""Greedy output of our engine must equal transformers' generate, token for token (float32, CPU)."""

import random

import pytest
import torch

from engine import LLM, SamplingParams
from tests.hf_models import make_hf_model

# family -> a second shape that flips GQA/MHA, top-k and expert count.
VARIANTS = {
    "mixtral": [{}, dict(num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=1, hidden_size=56)],
    "qwen2_moe": [{}, dict(num_key_value_heads=1, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[])],
    "qwen3_moe": [{}, dict(num_key_value_heads=4, num_experts=5, num_experts_per_tok=2, norm_topk_prob=False, head_dim=12)],
    "olmoe": [{}, dict(num_key_value_heads=1, num_experts=12, num_experts_per_tok=3, clip_qkv=0.9, norm_topk_prob=True)],
    # One shape (each costs ~20 s of transformers' generate): two layers (sliding, full; a window of 8), the
    # published YaRN rope but over 64 original positions, so the prompts reach well past them.
    "gpt_oss": [dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
        original_max_position_embeddings=64))],
}
CASES = [(fam, i) for fam, variants in VARIANTS.items() for i in range(len(variants))]
# Families also checked with a forced prefix-cache hit and with n-gram speculation (``CACHE_SPEC_MODES``).
CACHE_SPEC_FAMILIES = ("gpt_oss",)
CACHE_SPEC_CASES = [case for case in CASES if case[0] in CACHE_SPEC_FAMILIES]

# Engine settings that force each code path on the same requests. Without preemption, a pool of 256 blocks of 16
# holds every request at once (8 of at most 240 tokens): the pool sized from memory (2 GB, ~1.5 s to build per
# engine on the CPU) would compare nothing more.
ROOMY_POOL = 256
MODES = {
    "default": dict(num_kv_blocks=ROOMY_POOL),
    "chunked_prefill": dict(num_kv_blocks=ROOMY_POOL, max_num_batched_tokens=24),  # prompts up to 200 tokens: many
    # chunks, mixed with decodes
    "preemption": dict(num_kv_blocks=18, block_size=16, max_num_batched_tokens=64),  # room for ~1-2 sequences
    # Overlapped scheduling (tokens fed to the next step on the device, stop checks one step behind), chunked
    # prefill and preemption included: the small pool preempts here too.
    "overlap": dict(overlap_scheduling=True, num_kv_blocks=18, block_size=16, max_num_batched_tokens=48),
}
for _mode in ("default", "chunked_prefill", "preemption"):
    MODES[_mode].setdefault("overlap_scheduling", False)  # the synchronous loop, whatever the device's default
CACHE_SPEC_MODES = {
    # Request 1 runs alone first; request 2 starts with 100 of its prompt tokens, so it must hit the cache.
    "prefix_cache": dict(num_kv_blocks=ROOMY_POOL, overlap_scheduling=False),
    "ngram": dict(num_kv_blocks=ROOMY_POOL, speculative="ngram", num_speculative_tokens=4, speculative_max_batch=64,
                  speculative_min_acceptance=0.0),
}


def make_requests(rng: random.Random, vocab: int, n: int = 8) -> list[tuple[list[int], int]]:
    """n (prompt, max_tokens); request 2's prompt starts with request 1's first 100 tokens."""
    lengths = [3, 200] + [rng.randint(3, 200) for _ in range(n - 2)]
    reqs = [([rng.randrange(1, vocab - 1) for _ in range(length)], rng.randint(4, 40)) for length in lengths]
    reqs[2] = (reqs[1][0][:100] + reqs[2][0][:60], reqs[2][1])
    return reqs


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


_REFERENCES: dict[tuple[str, int], tuple] = {}  # one transformers run per case, shared by both fixtures


def _reference(case: tuple[str, int], tmp_path_factory) -> tuple:
    if case not in _REFERENCES:
        family, variant = case
        seed = random.randrange(2**31)
        path = str(tmp_path_factory.mktemp(f"{family}{variant}"))
        vocab = 211
        hf = make_hf_model(family, path, seed=seed, vocab_size=vocab, **VARIANTS[family][variant])
        reqs = make_requests(random.Random(seed), vocab)
        expected = [hf_greedy(hf, p, m) for p, m in reqs]
        _REFERENCES[case] = path, reqs, expected, seed
    return _REFERENCES[case]


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-v{i}" for f, i in CASES])
def reference(request, tmp_path_factory):
    return _reference(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=CACHE_SPEC_CASES, ids=[f"{f}-v{i}" for f, i in CACHE_SPEC_CASES])
def cache_spec_reference(request, tmp_path_factory):
    return _reference(request.param, tmp_path_factory)


def _check_outputs(reqs, outs, expected, seed) -> None:
    for (prompt, max_tokens), out, ref in zip(reqs, outs, expected):
        assert out.token_ids == ref, f"seed={seed} prompt_len={len(prompt)}"
        assert out.finish_reason == "length" and len(out.token_ids) == max_tokens
        assert out.num_prompt_tokens == len(prompt)


def _params(reqs) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(reference, mode):
    path, reqs, expected, seed = reference
    llm = LLM(model=path, dtype="float32", device="cpu", **MODES[mode])
    outs = llm.generate([p for p, _ in reqs], _params(reqs))
    _check_outputs(reqs, outs, expected, seed)
    scheduler = llm.engine.scheduler
    if mode in ("preemption", "overlap"):
        assert scheduler.num_preemptions > 0, "the small KV pool should have forced preemption"
    else:
        assert scheduler.num_preemptions == 0, f"seed={seed}: the roomy pool should hold every request"
    scheduler.kv.pool.check_all_free()
    assert not scheduler.running and not scheduler.waiting


@pytest.mark.parametrize("mode", list(CACHE_SPEC_MODES))
def test_cache_hits_and_speculation_match_transformers(cache_spec_reference, mode):
    path, reqs, expected, seed = cache_spec_reference
    llm = LLM(model=path, dtype="float32", device="cpu", **CACHE_SPEC_MODES[mode])
    if mode == "prefix_cache":
        first = llm.generate([reqs[1][0]], _params(reqs[1:2]))
        rest = [r for i, r in enumerate(reqs) if i != 1]
        outs = llm.generate([p for p, _ in rest], _params(rest))
        _check_outputs(reqs[1:2] + rest, first + outs, expected[1:2] + [e for i, e in enumerate(expected) if i != 1], seed)
        assert llm.engine.scheduler.kv.prefix_hit_tokens >= 96, f"seed={seed}: request 2 should reuse 6 full blocks"
    else:
        _check_outputs(reqs, llm.generate([p for p, _ in reqs], _params(reqs)), expected, seed)
        stats = llm.engine.stats()
        assert stats.spec_accepted_tokens > 0, f"seed={seed}: no n-gram draft was accepted"
        assert stats.spec_draft_tokens > stats.spec_accepted_tokens, f"seed={seed}: no draft was rejected"
    llm.engine.scheduler.kv.pool.check_all_free()
