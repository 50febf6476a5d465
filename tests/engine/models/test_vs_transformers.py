"""Greedy output of our engine must equal transformers' generate, token for token (float32, CPU)."""

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.kv_cache_manager import sliding_blocks_bound
from tests.hf_models import make_hf_model

# family -> a second shape that flips GQA/MHA, top-k and expert count.
VARIANTS = {
    "mixtral": [{}, dict(num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=1, hidden_size=56)],
    "qwen2_moe": [{}, dict(num_key_value_heads=1, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[])],
    "qwen3_moe": [{}, dict(num_key_value_heads=4, num_experts=5, num_experts_per_tok=2, norm_topk_prob=False, head_dim=12)],
    "olmoe": [{}, dict(num_key_value_heads=1, num_experts=12, num_experts_per_tok=3, clip_qkv=0.9, norm_topk_prob=True)],
    "glm4_moe": [{}],
    "dots1": [{}],
    "minimax_m2": [{}],
    # Two layers (sliding, full; a window of 8), the published YaRN rope but over 64 original positions, so the
    # prompts reach well past both.
    "gpt_oss": [dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
        original_max_position_embeddings=64))],
    # V2-Lite's shape, then V2's grouped softmax routing (groups scored by their best expert, scaled weights).
    "deepseek_v2": [{}, dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.7,
                             num_attention_heads=2, v_head_dim=16)],
    # V3's shape, then plain (non-interleaved) rope with YaRN scaling whose mscale_all_dim scales the softmax.
    # Three layers (full, sliding, sliding; see tests/hf_models.py), weights drawn narrower: outputs that loop
    # often enough for n-gram drafts to be accepted.
    "mimo_v2_flash": [dict(initializer_range=0.05)],
    "hy_v3": [{}],
    "deepseek_v3": [{}, dict(rope_interleave=False, n_group=2, topk_group=1, num_experts_per_tok=3,
                             rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.8,
                                                  mscale_all_dim=0.7, original_max_position_embeddings=256))],
}

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
# Every path in one run: chunked prefill, preemption (a small pool), prefix-cache hits (prompts sharing a
# prefix, see ``make_requests``) and n-gram speculation (prompts that loop); each is asserted to have happened.
MODES["all_paths"] = dict(num_kv_blocks=12, block_size=16, max_num_batched_tokens=24, speculative="ngram",
                          num_speculative_tokens=3, speculative_max_batch=64)
# gpt-oss's sliding layers keep their own block tables (a second KV cache group) whose blocks go back to the pool
# as the window passes them: blocks of 4 tokens, so its window of 8 passes most of every prompt. A block then holds
# one layer's K/V (the other group's layer shares its tensors): 96 such blocks are the memory of the 12 above.
FAMILY_OVERRIDES = {"gpt_oss": dict(block_size=4, num_kv_blocks=96),
                    # A token budget of 16: every long prompt is many chunks.
                    "mimo_v2_flash": dict(max_num_batched_tokens=16), "hy_v3": dict(max_num_batched_tokens=16)}
# Families checked again by a second pass over the same prompts on the same engine: every prompt's blocks are
# cached by then, so the pass hits (more cached tokens than the first) and must give the same tokens.
SECOND_PASS = ("mimo_v2_flash", "hy_v3")
for _mode in ("default", "chunked_prefill", "preemption", "all_paths"):
    MODES[_mode].setdefault("overlap_scheduling", False)  # the synchronous loop, whatever the device's default

# The families served before the routing kinds run every mode but the combined one; the newer ones (a few
# seconds each) run the combined one alone.
FAMILY_MODES = {fam: ["all_paths"] if fam in ("glm4_moe", "dots1", "minimax_m2", "gpt_oss", "mimo_v2_flash", "hy_v3") else ["default", "chunked_prefill",
                "preemption", "overlap"] for fam in VARIANTS}
# MLA's latent cache under every path at once; gpt-oss's sliding cache group and MiMo-V2-Flash's windowed layers
# also with overlapped steps.
FAMILY_MODES.update(deepseek_v2=["all_paths"], deepseek_v3=["all_paths"], gpt_oss=["all_paths", "overlap"],
                    mimo_v2_flash=["all_paths", "overlap"])
# A family's second variant (other head counts, routing settings) changes the layers, not the scheduler's paths:
# the roomy pool and overlapped steps (chunked prefill and preemption included) check it; the synchronous
# chunked and preempting runs stay with the first variant.
CASES = [((fam, i), mode) for fam, variants in VARIANTS.items() for i in range(len(variants)) for mode in FAMILY_MODES[fam]
         if i == 0 or mode not in ("chunked_prefill", "preemption")]


def make_requests(rng: random.Random, vocab: int, n: int = 8) -> list[tuple[list[int], int]]:
    lengths = [3, 200] + [rng.randint(3, 200) for _ in range(n - 2)]
    return [([rng.randrange(1, vocab - 1) for _ in range(length)], rng.randint(4, 40)) for length in lengths]


def make_path_requests(rng: random.Random, vocab: int, hf) -> tuple[list[tuple[list[int], int]], list[list[int]]]:
    """Requests for the combined mode, and transformers' greedy tokens for each: three share a 40-token prefix
    (prefix-cache hits once the first has computed its blocks), two end in a greedy continuation of their own
    (the output repeats the context, so n-gram drafts get accepted), two are long. Together they need about four
    times the combined mode's pool while most of them run at once: some are preempted."""
    prefix = [rng.randrange(1, vocab - 1) for _ in range(40)]
    prompts = [prefix + [rng.randrange(1, vocab - 1) for _ in range(rng.randint(1, 30))] for _ in range(3)]
    for _ in range(2):
        pattern = [rng.randrange(1, vocab - 1) for _ in range(rng.randint(2, 5))]
        start = (pattern * 20)[:rng.randint(10, 40)]
        prompts.append(start + hf_greedy(hf, start, 16))
    prompts += [[rng.randrange(1, vocab - 1) for _ in range(130)] for _ in range(2)]
    reqs = [(p, rng.randint(16, 32)) for p in prompts]
    return reqs, [hf_greedy(hf, p, m) for p, m in reqs]


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    # The attention mask is explicit: generate would otherwise infer one from pad_token_id and mask every prompt
    # token 0 as padding (a prompt built from an earlier greedy continuation can hold token 0).
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=max_new,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """(family, variant) -> its checkpoint, requests, transformers' tokens and seed; each built once per module."""
    built = {}

    def get(family: str, variant: int):
        if (family, variant) not in built:
            seed = random.randrange(2**31)
            path = str(tmp_path_factory.mktemp(f"{family}{variant}"))
            vocab = 211
            hf = make_hf_model(family, path, seed=seed, vocab_size=vocab, **VARIANTS[family][variant])
            rng = random.Random(seed)
            if "all_paths" in FAMILY_MODES[family]:
                reqs, expected = make_path_requests(rng, vocab, hf)
            else:
                reqs = make_requests(rng, vocab)
                expected = [hf_greedy(hf, p, m) for p, m in reqs]
            built[family, variant] = path, reqs, expected, seed
        return built[family, variant]

    return get


@pytest.mark.parametrize("case,mode", CASES, ids=[f"{f}-v{i}-{mode}" for (f, i), mode in CASES])
def test_greedy_matches_transformers(references, case, mode):
    path, reqs, expected, seed = references(*case)
    settings = {**MODES[mode], **FAMILY_OVERRIDES.get(case[0], {})}
    llm = LLM(model=path, dtype="float32", device="cpu", **settings)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    outs = llm.generate([p for p, _ in reqs], params)
    for (prompt, max_tokens), out, ref in zip(reqs, outs, expected):
        assert out.token_ids == ref, f"seed={seed} prompt_len={len(prompt)}"
        assert out.finish_reason == "length" and len(out.token_ids) == max_tokens
        assert out.num_prompt_tokens == len(prompt)
    scheduler = llm.engine.scheduler
    if mode == "all_paths":
        assert scheduler.kv.prefix_hit_tokens > 0, f"seed={seed}: no prefix-cache hit"
        assert scheduler.spec_accepted_tokens > 0, f"seed={seed}: no n-gram draft was accepted"
        assert max(len(p) for p, _ in reqs) > settings["max_num_batched_tokens"]  # prompts chunked
    # gpt-oss alone has a sliding group (every other family keeps one block table); its blocks per request stay
    # within its window's while the full group's grow with the request.
    assert len(scheduler.kv.windows) == (2 if case[0] == "gpt_oss" else 1)
    if case[0] == "gpt_oss":
        window, block_size = scheduler.kv.windows[1], settings["block_size"]
        full_peak, sliding_peak = scheduler.stats().kv_peak_request_blocks
        assert sliding_peak <= sliding_blocks_bound(window, block_size, settings["max_num_batched_tokens"])
        assert full_peak >= -(-max(len(p) for p, _ in reqs) // block_size) > sliding_peak
    if mode in ("preemption", "overlap", "all_paths"):
        assert scheduler.num_preemptions > 0, "the small KV pool should have forced preemption"
    else:
        assert scheduler.num_preemptions == 0, f"seed={seed}: the roomy pool should hold every request"
    scheduler.kv.pool.check_all_free()
    assert not scheduler.running and not scheduler.waiting
    if case[0] in SECOND_PASS and mode == "all_paths":
        second_pass_hits(path, reqs, expected, seed)


def prefix_and_long_reference(tmp_path_factory, name: str, make_model, vocab: int = 211):
    """A random checkpoint ``make_model(path, seed)`` saves (returning transformers' model of it) and requests for
    it: three prompts share a 40-token prefix, then prompts of 3, 100 and 130 tokens; 16 new tokens for the long
    ones, 4 to 12 for the others. -> (checkpoint, requests, transformers' tokens, seed)."""
    seed = random.randrange(2**31)
    path = str(tmp_path_factory.mktemp(name))
    hf = make_model(path, seed)
    rng = random.Random(seed)
    prefix = [rng.randrange(1, vocab - 1) for _ in range(40)]
    prompts = [prefix + [rng.randrange(1, vocab - 1) for _ in range(rng.randint(1, 30))] for _ in range(3)]
    prompts += [[rng.randrange(1, vocab - 1) for _ in range(n)] for n in (3, 100, 130)]
    reqs = [(p, 16 if len(p) >= 100 else rng.randint(4, 12)) for p in prompts]
    return path, reqs, [hf_greedy(hf, p, m) for p, m in reqs], seed


def second_pass_hits(path: str, reqs: list[tuple[list[int], int]], expected: list[list[int]], seed: int) -> None:
    """Two passes over the same prompts on an engine whose pool holds them all (chunks of 16 tokens): both give
    transformers' tokens, and the second takes every whole block of every prompt from the prefix cache."""
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=ROOMY_POOL, block_size=16,
              max_num_batched_tokens=16, overlap_scheduling=False)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    kv = llm.engine.scheduler.kv
    for attempt in ("first", "second"):
        hits_before = kv.prefix_hit_tokens
        outs = llm.generate([p for p, _ in reqs], params)
        assert [o.token_ids for o in outs] == expected, f"seed={seed}: the {attempt} pass differs"
    # The last prompt token is always computed (its logits are sampled), so a whole prompt hits its blocks before it.
    assert kv.prefix_hit_tokens - hits_before == sum((len(p) - 1) // 16 * 16 for p, _ in reqs), f"seed={seed}"
    kv.pool.check_all_free()
