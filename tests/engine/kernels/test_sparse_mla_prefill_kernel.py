"""Sparse MLA prefill through the Triton kernel (each query token one of its rows, with its own selected positions
and its request's block table): against float64 over random selections with NaN in every unselected row, and the
whole layer's prefill chunks against its torch path. Without a GPU it runs in Triton's CPU interpreter
(TRITON_INTERPRET=1 set here before anything imports triton)."""

import os
import random

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.layers import sparse_mla_attention  # noqa: E402
from tests.engine.layers import test_sparse_mla_attention as layer_test  # noqa: E402
from tests.engine.layers.test_sparse_prefill import BLOCK, _attend64, _step  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_prefill_queries_in_the_kernel_match_float64(monkeypatch):
    """Seven queries of a chunk ending a 21-token context, top-5 (fewer for some), in kernel launches of three."""
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    layer = layer_test._layer(False, seed).to(DEVICE)
    layer.prefill_kernel = "triton"
    width, heads = layer.kv_lora_rank + layer.rope_dim, layer.num_heads
    length, num_queries, topk = 21, 7, layer.indexer.index_topk
    monkeypatch.setattr(sparse_mla_attention, "SLICE_BUDGET", 3 * (heads * (2 * layer.kv_lora_rank + layer.rope_dim)
                                                                   + length))
    table = torch.randperm(9, generator=gen)[:6]
    cache = torch.full((10, BLOCK, width), float("nan"))
    select = torch.zeros(num_queries, length, dtype=torch.bool)
    for i in range(num_queries):
        seen = length - num_queries + i + 1
        select[i, 1 + torch.randperm(seen - 1, generator=gen)[:topk - i % 2]] = True  # odd queries keep 4
    ctx = torch.full((length, width), float("nan"))
    for p in select.any(dim=0).nonzero()[:, 0].tolist():
        ctx[p] = cache[table[p // BLOCK], p % BLOCK] = torch.randn(width, generator=gen)
    q = torch.randn(num_queries, heads, layer.nope_dim + layer.rope_dim, generator=gen)
    with torch.no_grad():
        got = layer._prefill_selected(q.to(DEVICE), cache.to(DEVICE), table.to(DEVICE), select.to(DEVICE)).cpu()
    layer = layer.cpu()
    for i in range(num_queries):
        torch.testing.assert_close(got[i].double(), _attend64(layer, q[i], ctx, select[i]), rtol=2e-5, atol=2e-5,
                                   msg=lambda m: f"seed={seed} query {i}: {m}")


def test_layer_prefills_alike_in_the_kernel():
    """A step of varlen prefill chunks (fresh, and over a cached prefix) through the kernel equals the torch path."""
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    layer = layer_test._layer(True, seed).to(DEVICE)
    layer.kv_cache = tuple(torch.zeros(12, BLOCK, *shape, device=DEVICE) for shape in layer.cache_spec().per_token)
    xs = [torch.randn(n, layer_test.HIDDEN).to(DEVICE) for n in (11, 14)]
    tables = [[4, 0, 8], [10, 2, 6, 1]]

    def part(r: int, start: int, n: int) -> layer_test.ScheduledRequest:
        return layer_test.ScheduledRequest(None, n, tables[r], True, start,
                                           [100 * r + p for p in range(start, start + n)])

    _step(layer, xs, [part(1, 0, 7)], DEVICE)
    scheduled = [part(0, 0, 11), part(1, 7, 7)]
    want, *_ = _step(layer, xs, scheduled, DEVICE)
    layer.prefill_kernel = "triton"
    got, *_ = _step(layer, xs, scheduled, DEVICE)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5, msg=lambda m: f"seed={seed}: {m}")
