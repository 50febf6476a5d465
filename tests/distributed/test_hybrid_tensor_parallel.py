"""Hybrid linear-attention models split over 2 tensor-parallel ranks (gloo, 1 thread each): Qwen3-Next (q/k/v/z
packed per key head) and Qwen3.5-MoE (q/k/v contiguous, a KV head replicated on both ranks) generate
transformers' greedy tokens on a workload that prefills in chunks, is preempted
(the states recomputed) and hits the prefix cache through state checkpoints (each rank copies its own heads'
states). (Kimi-Linear's delta attention is not split yet: refused at start, naming the flag, in
tests/engine/models/test_kimi_linear.py.)"""

import random

import pytest

from tests.distributed.split_references import check_split_generates_reference_tokens, split_runs_against_transformers
from tests.hf_models import make_hf_model

VOCAB = 151
# Two key heads (one per rank) with two value heads each; Qwen3.5's attention keeps one KV head (replicated).
FAMILIES = {"qwen3_next": {}, "qwen3_5_moe": dict(linear_num_key_heads=2, linear_num_value_heads=4)}
# 10 blocks of 16 tokens for a 70-token prompt decoding 10 beside others: preemption is forced; 16 tokens a step.
ENGINE = dict(dtype="float32", device="cpu", cpu_threads=1, block_size=16, num_kv_blocks=10,
              max_num_batched_tokens=16, max_num_seqs=4)


def _workload(rng: random.Random) -> tuple[list[list[int]], list[int]]:
    shared = [rng.randrange(1, VOCAB - 1) for _ in range(33)]  # two full blocks, then a third: a cached prefix
    prompts = [[rng.randrange(1, VOCAB - 1) for _ in range(n)] for n in (70, 2, 23)]
    return prompts + [shared + [3], shared + [5, 7]], [10, 6, 8, 5, 6]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    def build(family: str, path: str, seed: int):
        return make_hf_model(family, path, seed=seed, vocab_size=VOCAB, **FAMILIES[family])

    # One process: tests/engine/models/test_hybrid_*.
    return split_runs_against_transformers(tmp_path_factory, FAMILIES, build, _workload,
                                           dict(ENGINE, tensor_parallel_size=2), timeout_s=400)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_split_hybrid_models_generate_transformers_tokens(family, runs):
    results, refs = runs
    preemptions, hits, _ = check_split_generates_reference_tokens(family, results[family], refs[family])
    seed = results[family][0]
    assert preemptions > 0 and hits > 0, f"the workload must preempt and hit the prefix cache (seed={seed})"

