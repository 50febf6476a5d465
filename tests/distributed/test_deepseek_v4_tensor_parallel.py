"""DeepSeek-V4 split over 2 tensor-parallel ranks (gloo, 1 thread each): the query heads and their output groups
split (two heads, one group each), the shared key=value row, compressors and indexer whole on every rank, the routed
and shared experts split by intermediate slices, the hyper-connections whole. Greedy tokens equal transformers' (its
cached or its cache-free greedy path: they part where a router has a near tie, ``greedy_either_path``) on
a tiny random checkpoint with all three attention kinds (tests/engine/models/test_deepseek_v4.py), a window of 8
and compression windows of 4 and 8 under prompts of up to 70 tokens, prefilled in chunks of 16 tokens, on a KV
pool small enough to force preemption (each rank recomputes its states), with prefix-cache hits resumed from state
checkpoints. (One process: tests/engine/models/test_deepseek_v4*.py.)"""

import random

import pytest

from tests.distributed.split_references import (check_split_generates_reference_tokens,
                                                greedy_either_path, split_runs_against_transformers)
from tests.engine.models.test_deepseek_v4 import SETTINGS, SHAPE, VOCAB, WINDOW, make_v4_model

# The one-process test's pool (8 blocks of 16, a state checkpoint at every block boundary), 4 sequences at once.
ENGINE = dict(SETTINGS, dtype="float32", device="cpu", cpu_threads=1, max_num_seqs=4, tensor_parallel_size=2)


def _workload(rng: random.Random) -> tuple[list[list[int]], list[int]]:
    """A 70-token prompt decoding 10 beside others (preempted), a short one, one of 23, and two sharing a 33-token
    prefix (two full blocks: a prefix-cache hit once the first has computed them)."""
    shared = [rng.randrange(1, VOCAB - 1) for _ in range(33)]
    prompts = [[rng.randrange(1, VOCAB - 1) for _ in range(n)] for n in (70, 2, 23)]
    prompts += [shared + [3], shared + [5, 7]]
    longest_window = max(WINDOW, *SHAPE["compress_rates"].values())
    assert max(map(len, prompts)) > 4 * longest_window
    return prompts, [10, 6, 8, 5, 6]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    results, refs = split_runs_against_transformers(tmp_path_factory, ["deepseek_v4"],
                                                    lambda _, path, seed: make_v4_model(path, seed), _workload,
                                                    ENGINE, timeout_s=200, reference=greedy_either_path)
    return results["deepseek_v4"], refs["deepseek_v4"]


@pytest.mark.timeout(220)
def test_split_deepseek_v4_generates_transformers_tokens(run):
    result, reference = run
    preemptions, hits, _ = check_split_generates_reference_tokens("deepseek_v4", result, reference)
    assert preemptions > 0 and hits > 0, f"the workload must preempt and hit the prefix cache (seed={result[0]})"
