"""DeepSeek Sparse Attention families (DeepSeek-V3.2, GLM-5) split over 2 tensor-parallel ranks (gloo, 1 thread
each): MLA's heads split, the lightning indexer whole on each rank. Greedy tokens equal transformers' on tiny random
checkpoints whose indexer keeps 8 tokens, far fewer than the prompts hold, so the ranks' selections decide the
tokens; prompts are prefilled in chunks of 16 tokens and two of them hit the prefix cache. (One process:
tests/engine/models/test_sparse_attention.py.)"""

import random

import pytest

from tests.distributed.split_references import (check_split_generates_reference_tokens,
                                                split_runs_against_transformers, tie_ordered_greedy)
from tests.engine.models.test_sparse_attention import FAMILIES, INDEX_TOPK, VOCAB, make_dsa_model

# Two indexer heads, not eight: a query both of whose head weights are negative scores every key at most 0 and the
# keys both heads score below zero exactly 0, the best score, shared by many more keys than it keeps. Such ties
# decide the selection often, so ranks that broke them differently would differ.
INDEXER = dict(index_n_heads=2)
# 16 tokens a step (every prompt but the shortest is prefilled in chunks), blocks of 16 for the prefix cache.
ENGINE = dict(dtype="float32", device="cpu", cpu_threads=1, block_size=16, num_kv_blocks=16,
              max_num_batched_tokens=16, max_num_seqs=4, tensor_parallel_size=2)


def _workload(rng: random.Random) -> tuple[list[list[int]], list[int]]:
    """A 40-token prompt, a short one, and two sharing a 33-token prefix (two full blocks: a prefix-cache hit
    once the first has computed them), all but the short one longer than the indexer keeps."""
    shared = [rng.randrange(1, VOCAB - 1) for _ in range(33)]
    prompts = [[rng.randrange(1, VOCAB - 1) for _ in range(n)] for n in (40, 3)]
    prompts += [shared + [3], shared + [5, 7]]
    assert max(map(len, prompts)) > 4 * INDEX_TOPK
    return prompts, [8, 6, 6, 8]


def _build(family: str, path: str, seed: int):
    return make_dsa_model(family, path, seed, **FAMILIES[family], **INDEXER)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return split_runs_against_transformers(tmp_path_factory, FAMILIES, _build, _workload, ENGINE, timeout_s=280,
                                           reference=tie_ordered_greedy)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_split_sparse_attention_generates_transformers_tokens(family, runs):
    results, refs = runs
    _, hits, _ = check_split_generates_reference_tokens(family, results[family], refs[family])
    assert hits > 0, f"the workload must hit the prefix cache (family={family} seed={results[family][0]})"
