"""Expert-parallel dispatch on real gloo ranks: each rank brings its own tokens, uneven counts and none at all,
and gets back what running every token through all of its top-k experts gives, computed in float64 on one rank."""

import random

import pytest
import torch

from tests.distributed.ranks import run_ranks

H, I, E, K = 12, 10, 5, 2  # 5 experts over 2 ranks: 3 and 2


def _reference(x, w13, w2, weights, ids):
    # float64, token by token, expert by expert: SiLU(gate) * up, then down, weighted and summed over k.
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += weights[t, j].double() * (w2[e].double() @ (torch.nn.functional.silu(gate) * up))
    return out


def _inputs(seed: int, rank: int, num_tokens: int):
    gen = torch.Generator().manual_seed(seed)
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen) * 0.3, torch.randn(E, H, I, generator=gen) * 0.3
    gen.manual_seed(seed * 31 + rank)  # each rank's own tokens
    x = torch.randn(num_tokens, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(num_tokens)]) if num_tokens else \
        torch.zeros(0, K, dtype=torch.int64)
    weights = torch.rand(num_tokens, K, generator=gen)
    return x, w13, w2, weights, ids


def _rank_dispatch(rank: int, world: int, address: str, dispatch: str, seed: int, token_counts: list[list[int]]):
    import moe_kernels
    from engine.distributed.collectives import TensorParallel
    from engine.distributed.expert_parallel import ExpertParallel
    from engine.distributed.groups import RankGroups, RankInfo

    groups = RankGroups(RankInfo(rank, world, rank, address), torch.device("cpu"), timeout_s=30)
    tp = TensorParallel(groups)
    ep = ExpertParallel(tp, dispatch)
    first, count = ep.local_experts(E)
    errors = []
    for step, counts in enumerate(token_counts):
        x, w13, w2, weights, ids = _inputs(seed + step, rank, counts[rank])
        local13, local2 = w13[first:first + count], w2[first:first + count]

        def experts(xs, local_ids):
            ones = torch.ones(xs.shape[0], 1)
            return moe_kernels.fused_moe(xs, local13, local2, ones, local_ids[:, None], backend="torch")

        got = ep.dispatch(E).run(x, weights, ids, experts)
        want = _reference(x, w13, w2, weights, ids)
        errors.append((tuple(got.shape) == tuple(x.shape), (got.double() - want).abs().max().item() if x.numel() else 0.0))
    groups.close()
    return {"experts": (first, count), "errors": errors}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dispatch", ["all_to_all", "all_gather"])
def test_each_rank_gets_its_tokens_through_every_chosen_expert(dispatch):
    seed = random.randrange(2**20)
    # Per step, the tokens each rank brings: uneven, and a rank with none (it still joins the collectives).
    token_counts = [[5, 0], [1, 7], [0, 0], [3, 3]]
    results = run_ranks(_rank_dispatch, 2, dispatch, seed, token_counts, timeout_s=150)
    assert sorted(results) == [0, 1] and all(s == "ok" for s, _ in results.values()), results
    assert results[0][1]["experts"] == (0, 3) and results[1][1]["experts"] == (3, 2)
    for rank in (0, 1):
        for step, (shape_ok, err) in enumerate(results[rank][1]["errors"]):
            assert shape_ok and err < 1e-5, f"rank {rank} step {step} seed {seed}: max error {err}"
