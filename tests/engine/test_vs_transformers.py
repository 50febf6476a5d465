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
    # V2-Lite's shape, then V2's grouped softmax routing (groups scored by their best expert, scaled weights).
    "deepseek_v2": [{}, dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.7,
                             num_attention_heads=2, v_head_dim=16)],
    # V3's shape, then plain (non-interleaved) rope with YaRN scaling whose mscale_all_dim scales the softmax.
    "deepseek_v3": [{}, dict(rope_interleave=False, n_group=2, topk_group=1, num_experts_per_tok=3,
                             rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.8,
                                                  mscale_all_dim=0.7, original_max_position_embeddings=256))],
}
CASES = [(fam, i) for fam, variants in VARIANTS.items() for i in range(len(variants))]

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
    # The requests twice: the second pass hits the prefix cache; n-gram drafts verified in the forward.
    "prefix_speculation": dict(num_kv_blocks=ROOMY_POOL, speculative="ngram", num_speculative_tokens=3,
                               speculative_max_batch=64),
}
# Modes run for some families only (their paths are covered for the others by their own test files).
FAMILY_MODES = {"prefix_speculation": {"deepseek_v2", "deepseek_v3"}}
for _mode in ("default", "chunked_prefill", "preemption", "prefix_speculation"):
    MODES[_mode].setdefault("overlap_scheduling", False)  # the synchronous loop, whatever the device's default


def make_requests(rng: random.Random, vocab: int, n: int = 8) -> list[tuple[list[int], int]]:
    lengths = [3, 200] + [rng.randint(3, 200) for _ in range(n - 2)]
    return [([rng.randrange(1, vocab - 1) for _ in range(length)], rng.randint(4, 40)) for length in lengths]


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-v{i}" for f, i in CASES])
def reference(request, tmp_path_factory):
    family, variant = request.param
    seed = random.randrange(2**31)
    path = str(tmp_path_factory.mktemp(f"{family}{variant}"))
    vocab = 211
    hf = make_hf_model(family, path, seed=seed, vocab_size=vocab, **VARIANTS[family][variant])
    reqs = make_requests(random.Random(seed), vocab)
    expected = [hf_greedy(hf, p, m) for p, m in reqs]
    return path, reqs, expected, seed


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(reference, mode, request):
    path, reqs, expected, seed = reference
    family = request.node.callspec.params["reference"][0]
    if mode in FAMILY_MODES and family not in FAMILY_MODES[mode]:
        pytest.skip(f"{mode} runs for {sorted(FAMILY_MODES[mode])} (the others: tests/engine/test_speculative.py)")
    llm = LLM(model=path, dtype="float32", device="cpu", **MODES[mode])
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    outs = llm.generate([p for p, _ in reqs], params)
    if mode == "prefix_speculation":
        outs += llm.generate([p for p, _ in reqs], params)
    for (prompt, max_tokens), out, ref in zip(reqs * (len(outs) // len(reqs)), outs, expected * (len(outs) // len(reqs))):
        assert out.token_ids == ref, f"seed={seed} prompt_len={len(prompt)}"
        assert out.finish_reason == "length" and len(out.token_ids) == max_tokens
        assert out.num_prompt_tokens == len(prompt)
    scheduler = llm.engine.scheduler
    if mode == "chunked_prefill":
        assert max(len(p) for p, _ in reqs) > MODES[mode]["max_num_batched_tokens"], "a prompt must span chunks"
    if mode == "prefix_speculation":
        assert scheduler.kv.prefix_hit_tokens > 0, f"seed={seed}: the second pass should hit the prefix cache"
        assert scheduler.spec_draft_tokens > 0, f"seed={seed}: prompt lookup should have proposed drafts"
    if mode in ("preemption", "overlap"):
        assert scheduler.num_preemptions > 0, "the small KV pool should have forced preemption"
    else:
        assert scheduler.num_preemptions == 0, f"seed={seed}: the roomy pool should hold every request"
    scheduler.kv.pool.check_all_free()
    assert not scheduler.running and not scheduler.waiting
