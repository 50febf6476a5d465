"""The expert-load counters count top_k picks per computed token and nothing else: not the padding rows of the
CUDA-graph transforms' static buffers (decode steps padded to a batch size, prefill and mixed steps padded to a
token count), nor the all-padding warm-up runs before each capture.

Without a GPU the transforms run with ``capture=False``: the same buffers, padding and warm-ups, eagerly (the
decode graphs need the Triton attention kernels: the CPU interpreter runs them). The scheduler's count of
computed tokens is checked against the prompts and outputs too.
"""

import os
import random

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import LLM, KernelChoice, SamplingParams  # noqa: E402
from engine.transforms.cuda_graphs import enable_decode_graphs  # noqa: E402
from engine.transforms.piecewise_graphs import enable_piecewise_graphs  # noqa: E402
from tests.hf_models import make_hf_model  # noqa: E402

VOCAB = 97
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_counts_leave_out_padding_rows_and_warm_ups(tmp_path):
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    make_hf_model("qwen3_moe", str(tmp_path), seed=seed, vocab_size=VOCAB, num_layers=2)
    llm = LLM(model=str(tmp_path), kernel_choice=KernelChoice(attention="triton"), dtype="float32", device=DEVICE,
              num_kv_blocks=64, block_size=4, max_num_batched_tokens=24)
    runner = llm.engine.runner
    decode = enable_decode_graphs(runner, (2, 4), max_num_seqs=4, max_model_len=llm.engine.max_model_len,
                                  capture=False)
    pieces = enable_piecewise_graphs(runner, (16, 32), capture=False)
    for size in decode.sizes:  # what a capture runs first, once per size
        decode.warm_up(size)
    for size in pieces.sizes:
        for i in range(pieces.num_pieces):
            pieces.warm_up(i, size)
    prompts = [[rng.randrange(1, VOCAB - 1) for _ in range(n)] for n in (5, 11, 19)]
    max_tokens = 6
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    # Three decodes pad to 4 rows; steps of the prompts' 35 tokens (24 a step at most) pad to 32 or 16 rows.
    assert decode.replays > 0 and pieces.replays > 0, (decode.replays, pieces.replays)
    stats = llm.engine.scheduler.stats()
    tokens = stats.total_prefill_tokens + stats.total_decode_tokens
    # Every prompt token and every output token but the last is computed once (no preemption, no prefix hit).
    assert tokens == sum(len(p) + max_tokens - 1 for p in prompts), stats
    top_k = llm.engine.model_config.cfg("num_experts_per_tok")
    load = runner.expert_load.poll(runner.num_steps)
    if load is None:  # CUDA: the first poll queues a copy, a later one hands it out
        torch.cuda.synchronize()
        load = runner.expert_load.poll(runner.num_steps)
    assert [sum(layer) for layer in load] == [top_k * tokens] * len(runner.moe_blocks), f"seed={seed}"
