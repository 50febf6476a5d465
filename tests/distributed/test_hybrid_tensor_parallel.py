"""Hybrid linear-attention models split over 2 tensor-parallel ranks (gloo, 1 thread each): Qwen3-Next (q/k/v/z
packed per key head), Qwen3.5-MoE (q/k/v contiguous, a KV head replicated on both ranks) and Kimi-Linear (Kimi
Delta Attention's heads, their per-channel decays and convolutions split; latent attention's heads as DeepSeek's)
generate transformers' greedy tokens on a workload that prefills in chunks, is preempted (the states recomputed)
and hits the prefix cache through state checkpoints (each rank copies its own heads' states)."""

import random

import pytest

from tests.distributed.split_references import check_split_generates_reference_tokens, split_runs_against_transformers
from tests.engine.models.test_kimi_linear import make_kimi_model
from tests.hf_models import make_hf_model

VOCAB = 151
# Two key heads (one per rank) with two value heads each; Qwen3.5's attention keeps one KV head (replicated).
# Kimi-Linear cut to a KDA layer (2 heads: one per rank) over a dense MLP, then a latent-attention layer (4 heads)
# over the routed and shared experts.
FAMILIES = {"qwen3_next": {}, "qwen3_5_moe": dict(linear_num_key_heads=2, linear_num_value_heads=4),
            "kimi_linear": dict(linear_num_heads=2, layer_types=["linear_attention", "full_attention"],
                                mlp_layer_types=["dense", "sparse"])}
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
        if family == "kimi_linear":  # its own builder: kept out of tests.hf_models' every-family tests
            return make_kimi_model(path, seed, vocab_size=VOCAB, **FAMILIES[family])
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
