"""Hybrid models with their linear-attention layers on the Triton delta rule (the engine's Triton attention kernels
chosen) give transformers' greedy tokens on tiny random checkpoints: Qwen3-Next (per-head decay) and Kimi-Linear
(per-channel), prompts prefilled over several 16-token steps beside decodes, a one-token prompt among them.
Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 set here before anything imports
triton)."""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import LLM, KernelChoice, SamplingParams  # noqa: E402
from tests.engine.models.test_kimi_linear import make_kimi_model  # noqa: E402
from tests.engine.models.test_vs_transformers import hf_greedy  # noqa: E402
from tests.hf_models import make_hf_model  # noqa: E402

VOCAB = 97
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled kernels need CUDA tensors


@pytest.mark.parametrize("family", ["qwen3_next", "kimi_linear"])
def test_triton_rule_in_the_engine_matches_transformers(family, tmp_path, monkeypatch):
    import engine.kernels.delta_rule as delta_rule

    calls = []  # (decodes, prompt chunks) of every Triton call
    real = delta_rule.delta_rule_triton

    def counting(q, k, v, g, beta, rec_cache, states, *args):
        calls.append((states.num_decodes, len(states.prefills)))
        return real(q, k, v, g, beta, rec_cache, states, *args)

    monkeypatch.setattr(delta_rule, "delta_rule_triton", counting)
    seed = random.randrange(2**31)
    if family == "kimi_linear":
        hf = make_kimi_model(str(tmp_path), seed, vocab_size=VOCAB)
    else:
        hf = make_hf_model(family, str(tmp_path), seed=seed, vocab_size=VOCAB)
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, VOCAB - 1) for _ in range(n)] for n in (1, 6, 35)]
    expected = [hf_greedy(hf, p, 5) for p in prompts]
    llm = LLM(model=str(tmp_path), dtype="float32", device=DEVICE, kernel_choice=KernelChoice(attention="triton"),
              num_kv_blocks=16, block_size=16, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    got = [out.token_ids for out in llm.generate(prompts, params)]
    assert got == expected, f"seed={seed}"
    assert any(d and p for d, p in calls), f"seed={seed}: no step ran decodes and prompt chunks together"
