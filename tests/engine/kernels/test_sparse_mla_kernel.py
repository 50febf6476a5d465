"""The Triton sparse MLA decode kernel against a float64 reference: each request's heads over the latent rows of
its selected positions only. Without a GPU it runs in Triton's CPU interpreter (TRITON_INTERPRET=1 set here before
anything imports triton). Every cache row no request selected holds NaN, so a row read that should not be fails."""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.kernels.mla_attention import MlaDecodeLaunch  # noqa: E402
from engine.kernels.sparse_mla import sparse_mla_decode_triton  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank,rope", [(32, 16), (48, 8)])
def test_sparse_decode_matches_float64(dtype, rank, rope):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    heads, block_size, num_blocks, topk = 3, 4, 24, 20
    seq_lens = [30, 9, 17]  # the first selects 20 of 30 (two key tiles), the second all 9, the third none
    counts = [topk, 9, 0]
    tables = torch.randperm(num_blocks, generator=gen).view(3, 8)  # 8 blocks of 4 hold the longest context
    cache = torch.full((num_blocks + 1, block_size, rank + rope), float("nan"))
    positions = torch.full((3, topk), -1, dtype=torch.int64)
    for d, (n, k) in enumerate(zip(seq_lens, counts)):
        chosen = torch.randperm(n, generator=gen)[:k]
        positions[d, :k] = chosen
        for p in chosen.tolist():
            cache[tables[d, p // block_size], p % block_size] = torch.randn(rank + rope, generator=gen)
    q = torch.randn(3, heads, rank + rope, generator=gen)
    scale = (rank + rope) ** -0.5
    got = sparse_mla_decode_triton(q.to(DEVICE, dtype), cache.to(DEVICE, dtype), tables.to(DEVICE),
                                   positions.to(DEVICE), scale, rank, MlaDecodeLaunch(block_n=16)).double().cpu()
    q64, cache64 = q.to(dtype).double(), cache.to(dtype).double()
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    for d, k in enumerate(counts):
        if k == 0:
            assert torch.equal(got[d], torch.zeros_like(got[d])), f"seed={seed}: a request with no rows writes zeros"
            continue
        pos = positions[d, :k]
        rows = cache64[tables[d, pos // block_size], pos % block_size]  # [k, R + P]
        want = torch.softmax(q64[d] @ rows.T * scale, dim=-1) @ rows[:, :rank]  # [h, R]
        torch.testing.assert_close(got[d], want, rtol=tolerance, atol=tolerance, msg=lambda m: f"seed={seed}: {m}")


def test_sparse_layer_decodes_alike_in_the_kernel():
    """The sparse MLA layer's decodes (a group sharing a prefix block among them) through the kernel equal its
    torch decodes, step for step over the same paged cache."""
    from tests.engine.layers.test_sparse_mla_attention import BLOCK, HIDDEN, _layer, _run
    from engine.core.scheduler import ScheduledRequest

    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    layer = _layer(False, seed).to(DEVICE)
    layer.kv_cache = tuple(torch.zeros(17, BLOCK, *shape, device=DEVICE) for shape in layer.cache_spec().per_token)
    xs = [torch.randn(16, HIDDEN) for _ in range(3)]
    xs[1][:BLOCK] = xs[0][:BLOCK]
    xs = [x.to(DEVICE) for x in xs]
    tables = [[0, 1, 2, 3], [0, 4, 5, 6], [7, 8, 9, 10]]

    def part(r: int, start: int, n: int) -> ScheduledRequest:
        return ScheduledRequest(None, n, tables[r], True, start, [100 * r + p for p in range(start, start + n)])

    _run(layer, xs, [part(0, 0, 12), part(1, 0, 9), part(2, 0, 3)], DEVICE)
    for step in range(3):  # contexts from 4 (all kept) to 15 tokens (5 of them kept)
        scheduled = [part(0, 12 + step, 1), part(1, 9 + step, 1), part(2, 3 + step, 1)]
        layer.decode_kernel = "torch"
        want, meta = _run(layer, xs, scheduled, DEVICE)
        layer.decode_kernel = "triton"
        got, _ = _run(layer, xs, scheduled, DEVICE)
        assert any(g.shared_blocks is not None for g in meta.decode_groups)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=2e-5, atol=2e-5, msg=lambda m: f"seed={seed}: {m}")
