"""The engine gives the same greedy tokens with the Triton MoE kernels as with torch's.

Without a GPU the Triton kernels run in Triton's CPU interpreter. TRITON_INTERPRET
must be set before ``moe_kernels.triton_backend`` is first imported, so it is set
here at import (collection) time, and only when there is no CUDA.
"""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import LLM, KernelChoice, SamplingParams  # noqa: E402
from tests.hf_models import make_hf_model  # noqa: E402

# Tiny one-layer models: families with different E, k and renormalization; gpt-oss's experts have biases and
# the clamped SwiGLU.
FAMILIES = {"mixtral": dict(), "qwen3_moe": dict(norm_topk_prob=False), "gpt_oss": dict()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_triton_backend_matches_torch_backend(family, tmp_path, monkeypatch):
    import moe_kernels.triton_backend as triton_backend

    calls = []  # token count of every Triton call
    real = triton_backend.fused_moe_triton

    def counting(x, *args, **kwargs):
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(triton_backend, "fused_moe_triton", counting)
    seed = random.randrange(2**31)
    vocab = 97
    make_hf_model(family, str(tmp_path), seed=seed, vocab_size=vocab, num_layers=1, **FAMILIES[family])
    rng = random.Random(seed)
    # A 1-token prompt (decode-sized batches) and prompts longer than one 16-row block.
    prompts = [[rng.randrange(1, vocab - 1) for _ in range(n)] for n in (1, 21, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=str(tmp_path), kernel_choice=KernelChoice(moe=backend), dtype="float32", num_kv_blocks=64)
        tokens[backend] = [out.token_ids for out in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"], f"seed={seed} family={family}"
    assert all(len(t) == 6 for t in tokens["triton"])
    assert calls and max(calls) > 16, "the triton backend was not used (or never on a prefill-sized batch)"
