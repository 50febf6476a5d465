"""Slots of the KV cache that a query does not attend to never reach its output, whatever they hold.

A block is reused by request after request, and its slots past a request's length (or before its sliding
window, or padding a decode group to its longest member) still hold whatever an earlier request wrote there:
NaN or inf when an earlier request's activations were not finite (a broken LoRA adapter). A softmax weight
of 0 times NaN is NaN, so every attention path must keep such slots out of its sums, not only weigh them 0.

Each test fills every KV cache tensor of a fresh engine (the scratch block included, and a draft model's)
with NaN, +inf or 1e30 before the first request; the greedy tokens must still be transformers'.
Without a GPU the Triton kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 at collection).
"""

import math
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import LLM, KernelChoice, SamplingParams  # noqa: E402
from tests.engine.models.test_vs_transformers import hf_greedy  # noqa: E402
from tests.hf_models import make_hf_model  # noqa: E402

VOCAB = 97
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Blocks of 4 (partial last blocks in almost every request), prompts in chunks of at most 24 tokens.
ENGINE = dict(dtype="float32", device=DEVICE, num_kv_blocks=64, block_size=4, max_num_batched_tokens=24,
              overlap_scheduling=False)
POISONS = (math.nan, math.inf, 1e30)
# Standard attention with GQA (mixtral, qwen3_moe: one KV head), sinks with a sliding window on every other layer
# and its own cache group (gpt_oss), MLA without and with q LoRA (deepseek_v2, deepseek_v3).
FAMILIES = ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3")


def poison_(llm: LLM, value: float) -> None:
    """Fill every KV cache tensor of ``llm``'s engine (and of its draft model) with ``value``."""
    runner = llm.engine.runner
    caches = list(runner.kv_caches) + (list(runner.draft.kv_caches) if runner.draft is not None else [])
    for tensors in caches:
        for tensor in tensors:
            tensor.fill_(value)


def make_requests(rng: random.Random) -> list[tuple[list[int], int]]:
    """Three sharing a 14-token prefix (prefix-cache hits: chunks over cached blocks, then a decode group reading
    the shared blocks once), one of 1 token and one of 30 (padded decode groups, chunked prefill, past gpt-oss's
    window of 8), and two that repeat a pattern (n-gram drafts, where speculation is on)."""
    shared = [rng.randrange(1, VOCAB - 1) for _ in range(14)]
    prompts = [shared + [rng.randrange(1, VOCAB - 1) for _ in range(n)] for n in (3, 9, 5)]
    prompts += [[rng.randrange(1, VOCAB - 1) for _ in range(n)] for n in (1, 30)]
    for period, length in ((2, 11), (3, 17)):
        pattern = [rng.randrange(1, VOCAB - 1) for _ in range(period)]
        prompts.append((pattern * length)[:length])
    return [(p, rng.randint(6, 12)) for p in prompts]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """family -> (checkpoint path, requests, transformers' greedy tokens, seed), built once per module."""
    built = {}

    def get(family: str):
        if family not in built:
            seed = random.randrange(2**31)
            path = str(tmp_path_factory.mktemp(family))
            hf = make_hf_model(family, path, seed=seed, vocab_size=VOCAB, num_layers=2)
            reqs = make_requests(random.Random(seed))
            built[family] = path, reqs, [hf_greedy(hf, p, m) for p, m in reqs], seed
        return built[family]

    return get


def _run(llm: LLM, reqs: list[tuple[list[int], int]]) -> list[list[int]]:
    # The first request alone, so the second finds its prefix blocks cached; then the rest together.
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    prompts = [p for p, _ in reqs]
    outs = llm.generate(prompts[:1], params[:1]) + llm.generate(prompts[1:], params[1:])
    return [out.token_ids for out in outs]


# The Triton kernels (interpreted on the CPU: seconds each) on one family per kernel: standard attention, with
# sinks and a window, MLA.
TRITON_FAMILIES = ("qwen3_moe", "gpt_oss", "deepseek_v3")
CASES = [(family, "torch") for family in FAMILIES] + [(family, "triton") for family in TRITON_FAMILIES]


@pytest.mark.parametrize("family,backend", CASES)
def test_poisoned_pool_gives_transformers_tokens(references, family, backend):
    """Every poison on the torch path; one per family on the Triton kernels, each poison on some family. The
    kernels' loads are masked by position, so the value makes no difference there."""
    path, reqs, expected, seed = references(family)
    for value in POISONS if backend == "torch" else POISONS[TRITON_FAMILIES.index(family) % len(POISONS):][:1]:
        llm = LLM(model=path, kernel_choice=KernelChoice(attention=backend), **ENGINE)
        poison_(llm, value)
        got = _run(llm, reqs)
        assert got == expected, f"seed={seed} family={family} backend={backend} poison={value}"
        assert llm.engine.scheduler.kv.prefix_hit_tokens > 0, "the shared prefix was never a cache hit"
    if family.startswith("deepseek") and backend == "torch":  # MLA's other decode form (kept for comparison)
        llm = LLM(model=path, kernel_choice=KernelChoice(attention=backend), **ENGINE)
        for layer in llm.engine.runner.model.attention_layers():
            layer.decode_form = "expanded"
        poison_(llm, math.nan)
        assert _run(llm, reqs) == expected, f"seed={seed} family={family} (expanded decode)"


@pytest.mark.parametrize("backend,proposer", [("torch", "ngram"), ("torch", "draft"), ("triton", "ngram")])
def test_poisoned_pool_with_speculation(references, backend, proposer):
    """Draft rows verified over a poisoned pool (and, with a draft model, its own poisoned caches; the draft model
    runs the same kernels as the target, so the Triton ones once)."""
    path, reqs, expected, seed = references("qwen3_moe")
    draft = dict(speculative_model=path) if proposer == "draft" else {}
    llm = LLM(model=path, kernel_choice=KernelChoice(attention=backend), speculative=proposer,
              num_speculative_tokens=3, **draft, **ENGINE)
    poison_(llm, math.nan)
    assert _run(llm, reqs) == expected, f"seed={seed} backend={backend} proposer={proposer}"
    assert llm.engine.stats().spec_accepted_tokens > 0, f"seed={seed}: no draft was accepted"
