"""Sparse MLA prefill reading only each query's selected latent rows, against float64 references written from the
definition: per query, softmax attention over its selected tokens only, keys and values expanded from the latents.

The layer's chunk path (``_prefill_selected``) is fed random selections over a paged cache whose every row no query
selected holds NaN (a row read that should not be, or a padded slot multiplied by 0, fails). The whole layer runs
varlen prefill chunks (fresh, over a cached prefix, shorter and longer than top-k) and is compared with masked dense
attention in float64 under the selection its indexer made. Slices of a few queries are forced throughout."""

import random

import pytest
import torch

from engine.layers import sparse_mla_attention
from engine.layers.sparse_mla_attention import SparseMLAttention
from tests.engine.layers import test_sparse_mla_attention as layer_test

BLOCK = layer_test.BLOCK


def _budget(layer: SparseMLAttention, queries: int, topk: int, length: int) -> int:
    """The ``SLICE_BUDGET`` that makes the torch path's slices ``queries`` queries long (as the layer counts)."""
    return queries * (topk * (layer.kv_lora_rank + layer.rope_dim + 2 * layer.num_heads) + length)


def _attend64(layer: SparseMLAttention, q: torch.Tensor, ctx: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """One query q [h, n + p] over the latent rows ctx [L, r + p] at the positions ``chosen`` [L] selects, in
    float64 and the expanded form (per-head keys and values from kv_b_proj) -> [h, v]."""
    r, nope = layer.kv_lora_rank, layer.nope_dim
    w = layer.kv_b_proj.weight.double().view(layer.num_heads, nope + layer.v_dim, r)
    rows = ctx[chosen.nonzero()[:, 0]].double()  # [k, r + p]: only the selected rows, NaN elsewhere never read
    out = []
    for h in range(layer.num_heads):
        keys = torch.cat([rows[:, :r] @ w[h, :nope].T, rows[:, r:]], dim=-1)  # [k, n + p]
        values = rows[:, :r] @ w[h, nope:].T  # [k, v]
        out.append(torch.softmax(keys @ q[h].double() * layer.scale, dim=0) @ values)
    return torch.stack(out)


@pytest.mark.parametrize("topk", [4, 9, 40], ids=["topk-below", "topk-mid", "topk-above-context"])
def test_chunk_attends_to_its_selected_rows_only(monkeypatch, topk):
    """A chunk's last 11 queries over a 29-token context in scattered blocks: each query keeps a random subset of
    its visible tokens but the first (at most top-k, fewer for some, all the rest for early ones when top-k exceeds what
they see)."""
    for _ in range(3):  # three seeds a parameter
        seed = random.randrange(2**31)
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        layer = layer_test._layer(False, seed)
        layer.indexer.index_topk = topk
        monkeypatch.setattr(sparse_mla_attention, "SLICE_BUDGET", _budget(layer, 3, min(topk, 29), 29))
        width = layer.kv_lora_rank + layer.rope_dim
        length, num_queries, num_blocks = 29, 11, 12
        table = torch.randperm(num_blocks, generator=gen)[:8]  # 8 blocks of 4 hold 29 tokens (slot 31 is spare)
        cache = torch.full((num_blocks + 1, BLOCK, width), float("nan"))
        select = torch.zeros(num_queries, length, dtype=torch.bool)
        for i in range(num_queries):
            seen = length - num_queries + i + 1  # causal: query i sees positions [0, seen)
            keep = min(topk, seen - 1) - (i % 3 == 1)  # some queries keep fewer than they could
            # Position 0 is never selected, so its row stays NaN: the padded slots' reads land there.
            select[i, 1 + torch.randperm(seen - 1, generator=gen)[:keep]] = True
        ctx = torch.full((length, width), float("nan"))
        for p in select.any(dim=0).nonzero()[:, 0].tolist():  # only rows some query selected hold numbers
            ctx[p] = cache[table[p // BLOCK], p % BLOCK] = torch.randn(width, generator=gen)
        q = torch.randn(num_queries, layer.num_heads, layer.nope_dim + layer.rope_dim, generator=gen)
        with torch.no_grad():
            got = layer._prefill_selected(q, cache, table, select)
        for i in range(num_queries):
            torch.testing.assert_close(got[i].double(), _attend64(layer, q[i], ctx, select[i]), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"seed={seed} query {i}: {m}")


def _step(layer: SparseMLAttention, xs: list[torch.Tensor], scheduled, device: torch.device = torch.device("cpu")):
    """One step on ``device`` (the layer's, xs's): -> (out [T, h, v], q [T, h, n + p], the batch's token ids, its
    metadata)."""
    batch = layer_test.build_batch(scheduled, "torch", BLOCK, None, 1, device)
    ids = batch.input_ids.tolist()
    x = torch.stack([xs[i // 100][i % 100] for i in ids])  # [T, H]
    with torch.no_grad():
        projected = layer.project(x, batch.positions)
        out = layer.attend(*projected, batch.meta)
    return out, projected[0], ids, batch.meta


@pytest.mark.parametrize("kernel", ["torch", "masked"])
@pytest.mark.parametrize("topk", [3, 6], ids=["topk-3", "topk-6"])
def test_layer_prefill_matches_masked_dense_float64(monkeypatch, topk, kernel):
    """Varlen prefill chunks in one step (a fresh prompt longer than top-k, one shorter, a second chunk over a
    cached prefix) with NaN in every slot not yet written: each query's output equals float64 masked dense attention
    over the cached latents under the selection the layer's indexer made, which keeps min(top-k, visible) tokens;
    gathering each query's rows (the CPU default) or masking dense attention over the context (the CUDA default)."""
    for _ in range(2):
        seed = random.randrange(2**31)
        torch.manual_seed(seed)
        layer = layer_test._layer(True, seed)
        layer.indexer.index_topk = topk
        layer.prefill_kernel = kernel
        monkeypatch.setattr(sparse_mla_attention, "SLICE_BUDGET", _budget(layer, 2, topk, 15))  # 2 to 3 a slice
        layer.kv_cache = tuple(torch.full((14, BLOCK, *shape), float("nan")) for shape in layer.cache_spec().per_token)
        xs = [torch.randn(n, layer_test.HIDDEN) for n in (13, 3, 15)]
        tables = [[5, 0, 9, 2], [7], [12, 3, 11, 1]]

        def part(r: int, start: int, n: int) -> layer_test.ScheduledRequest:
            return layer_test.ScheduledRequest(None, n, tables[r], True, start,
                                               [100 * r + p for p in range(start, start + n)])

        layer_test._run(layer, xs, [part(2, 0, 6)])  # request 2's first chunk: its cached prefix
        out, q, ids, meta = _step(layer, xs, [part(0, 0, 13), part(1, 0, 3), part(2, 6, 9)])
        assert not meta.decode_groups and meta.prefill_masks[2] is not None  # the chunk over a prefix is masked
        latents = layer.kv_cache[0].double()
        for chunk, ((start, end), seq_len) in enumerate(zip(meta.prefill_query_ranges, meta.prefill_seq_lens)):
            select = layer.relay.selections[chunk][0]  # [q, L]
            r = ids[start] // 100
            ctx = torch.stack([latents[tables[r][p // BLOCK], p % BLOCK] for p in range(seq_len)])  # [L, r + p]
            for i in range(end - start):
                seen = seq_len - (end - start) + i + 1
                assert not select[i, seen:].any() and int(select[i].sum()) == min(topk, seen), f"seed={seed}"
                torch.testing.assert_close(out[start + i].double(), _attend64(layer, q[start + i], ctx, select[i]),
                                           rtol=1e-5, atol=1e-6, msg=lambda m: f"seed={seed} chunk {chunk} {i}: {m}")
