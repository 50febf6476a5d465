"""Greedy output equals transformers' for all four families with every MoE layer on the grouped path.

tests/engine/models/test_vs_transformers.py covers the engine's modes; this one
pins which torch path runs: the per-expert loop is made to fail, and the
grouped path must have been called.
"""

import random

import pytest
import torch

import moe_kernels.torch_backend as torch_backend
from engine import LLM, SamplingParams
from tests.hf_models import FAMILY_CONFIGS, make_hf_model


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_greedy_matches_transformers_on_the_grouped_path(family, tmp_path, monkeypatch):
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    hf = make_hf_model(family, str(tmp_path), seed=seed, vocab_size=211)
    reqs = [([rng.randrange(1, 210) for _ in range(n)], rng.randint(4, 16)) for n in (3, 70, rng.randint(3, 120))]
    expected = []
    with torch.no_grad():
        for prompt, max_new in reqs:
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            expected.append(out[0, len(prompt):].tolist())

    grouped_calls = []
    real_grouped = torch_backend.fused_moe_grouped

    def counting_grouped(*args, **kwargs):
        grouped_calls.append(args[0].shape[0])
        return real_grouped(*args, **kwargs)

    def no_loop(*args, **kwargs):
        raise AssertionError("the per-expert loop ran: grouped_mm_supported refused this model's operands")

    monkeypatch.setattr(torch_backend, "fused_moe_grouped", counting_grouped)
    monkeypatch.setattr(torch_backend, "fused_moe_loop", no_loop)
    # 32 blocks of 16 hold the three requests at once (at most 136 tokens each), where the pool sized from memory
    # (2 GB) takes ~1.5 s to build on the CPU. Chunked prefill too.
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", max_num_batched_tokens=48, num_kv_blocks=32)
    outs = llm.generate([p for p, _ in reqs], [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs])
    assert grouped_calls, "no MoE layer ran through fused_moe_grouped"
    for out, ref in zip(outs, expected):
        assert out.token_ids == ref, f"{family} seed={seed}"
