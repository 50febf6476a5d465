"""MiniMax-M3's text model split over 2 tensor-parallel ranks (gloo, 1 thread each): its 4 attention heads and 2 KV
heads split (2 and 1 a rank; each rank's heads one indexer head's group), the block indexer whole on each rank, the
experts, shared expert and dense MLP split as MiniMax-M2's. Greedy tokens equal transformers' on a tiny random
checkpoint whose indexer keeps 3 blocks of 8 keys, fewer than the prompts span, so the ranks' selections decide
the tokens; prompts are prefilled in chunks of 16 tokens and two of them hit the prefix cache. (One process:
tests/engine/models/test_minimax_m3.py.)"""

import random

import pytest

from tests.distributed.split_references import check_split_generates_reference_tokens, split_runs_against_transformers
from tests.engine.models.test_minimax_m3 import M3_TEXT, VOCAB, make_m3_model

# 16 tokens a step (every prompt but the shortest is prefilled in chunks), blocks of 16 for the prefix cache.
ENGINE = dict(dtype="float32", device="cpu", cpu_threads=1, block_size=16, num_kv_blocks=16,
              max_num_batched_tokens=16, max_num_seqs=4, tensor_parallel_size=2)
KEPT_KEYS = M3_TEXT["index_topk_blocks"] * M3_TEXT["index_block_size"]


def _workload(rng: random.Random) -> tuple[list[list[int]], list[int]]:
    """A 56-token prompt, a short one, and two sharing a 33-token prefix (two full blocks: a prefix-cache hit once
    the first has computed them), all but the short one longer than the indexer keeps."""
    shared = [rng.randrange(1, VOCAB - 1) for _ in range(33)]
    prompts = [[rng.randrange(1, VOCAB - 1) for _ in range(n)] for n in (56, 3)]
    prompts += [shared + [3], shared + [5, 7]]
    assert min(len(p) for p in prompts if len(p) > 3) > KEPT_KEYS
    return prompts, [8, 6, 6, 8]


@pytest.mark.timeout(300)
def test_split_minimax_m3_generates_transformers_tokens(tmp_path_factory):
    results, refs = split_runs_against_transformers(tmp_path_factory, ["minimax_m3"],
                                                    lambda _, path, seed: make_m3_model(path, seed), _workload,
                                                    ENGINE, timeout_s=280)
    _, hits, _ = check_split_generates_reference_tokens("minimax_m3", results["minimax_m3"], refs["minimax_m3"])
    assert hits > 0, f"the workload must hit the prefix cache (seed={results['minimax_m3'][0]})"
