"""Sparse MLA decode reading only the selected latent rows (``engine.layers.selected_rows``) against float64 loops
over random inputs: each request's selected positions looked up one by one through its block table. Selections of
every size up to top-k, top-k larger than the context, tables padded with block 0, a shared prefix, and
non-finite values in every slot no request selected (an earlier request's leftovers) all run through it."""

import random

import torch

from engine.device_batch.attention_metadata import DecodeGroup
from engine.layers.selected_rows import context_table, gather_selected_rows, selected_positions
from engine.layers.sparse_mla_attention import SparseMLAttention
from tests.engine.layers import test_sparse_mla_attention as layer_test

RANK, ROPE, BLOCK = 6, 4, 4


def _attend(q: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """The absorbed decode's attention as the layer runs it: q [G, h, r + p] over rows [G, K, r + p] -> [G, h, r]."""
    return torch.nn.functional.scaled_dot_product_attention(q[:, None], rows[:, None], rows[:, None, :, :RANK],
                                                            attn_mask=valid[:, None, None], scale=scale)[:, 0]


def test_gathered_rows_attend_like_a_float64_loop():
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks, num_reqs, heads, scale = 24, 4, 3, 0.7
    cache = torch.randn(num_blocks + 1, BLOCK, RANK + ROPE, generator=gen)
    shared = torch.tensor([5, 11])  # two full prompt blocks every request's context starts with
    lengths = [rng.randint(1, 4 * BLOCK) for _ in range(num_reqs)]  # each request's own tokens after the prefix
    width = -(-max(lengths) // BLOCK)
    own = [b for b in range(1, num_blocks + 1) if b not in shared.tolist()]
    rng.shuffle(own)
    table = torch.zeros(num_reqs, width, dtype=torch.int64)  # padding: block 0
    for i, n in enumerate(lengths):
        table[i, :-(-n // BLOCK)] = torch.tensor([own.pop() for _ in range(-(-n // BLOCK))])
    key_mask = torch.arange(width * BLOCK)[None] < torch.tensor(lengths)[:, None]  # [G, W * bs]
    group = DecodeGroup(0, num_reqs, table, key_mask[:, None, None], shared_blocks=shared)
    full = context_table(group)  # [G, 2 + W]
    assert full[:, :2].tolist() == [shared.tolist()] * num_reqs and torch.equal(full[:, 2:], table)

    length = full.shape[1] * BLOCK
    topk = rng.choice([3, 9, length + 5])  # at times more than any context holds: every visible token then
    chosen = torch.zeros(num_reqs, length, dtype=torch.bool)
    for i, n in enumerate(lengths):
        seen = 2 * BLOCK + n
        chosen[i, rng.sample(range(seen), rng.randint(1, min(topk, seen)))] = True
    # Every slot no request selected holds non-finite leftovers: a masked row that was not zeroed would give NaN.
    slot_of = lambda i, p: int(full[i, p // BLOCK]) * BLOCK + p % BLOCK  # noqa: E731
    keep = {slot_of(i, p) for i in range(num_reqs) for p in chosen[i].nonzero()[:, 0].tolist()}
    flat = cache.view(-1, RANK + ROPE)
    for slot in set(range(flat.shape[0])) - keep:
        flat[slot] = float("nan") if slot % 2 else float("inf")

    positions = selected_positions(chosen, topk)  # [G, K]
    assert positions.shape == (num_reqs, min(topk, length))
    rows, valid = gather_selected_rows(cache, full, positions)
    q = torch.randn(num_reqs, heads, RANK + ROPE, generator=gen)
    got = _attend(q, rows, valid, scale)
    for i in range(num_reqs):
        picked = chosen[i].nonzero()[:, 0].tolist()
        assert sorted(positions[i][valid[i]].tolist()) == picked, f"seed={seed}"
        ref_rows = torch.stack([cache[int(full[i, p // BLOCK]), p % BLOCK] for p in picked]).double()  # [k, r + p]
        want = torch.softmax(scale * q[i].double() @ ref_rows.T, dim=-1) @ ref_rows[:, :RANK]  # [h, r]
        torch.testing.assert_close(got[i].double(), want, rtol=1e-5, atol=1e-6, msg=lambda m: f"seed={seed}: {m}")


def test_layer_decodes_with_top_k_above_its_contexts():
    """The whole layer (indexer, selection, gathered decode) over a padded decode group whose top-k exceeds every
    context, with non-finite values in the slots past each request's length, against the float64 layer loop."""
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    layer: SparseMLAttention = layer_test._layer(False, seed)
    layer.indexer.index_topk = 40  # above every context below: each query attends to all its tokens
    num_blocks = 12
    layer.kv_cache = tuple(torch.full((num_blocks + 1, BLOCK, *shape), float("nan"))
                           for shape in layer.cache_spec().per_token)
    lengths = (9, 5, 2)
    xs = [torch.randn(n, layer_test.HIDDEN) for n in lengths]
    tables = [[3, 7, 1], [4, 9], [11]]
    part = lambda r, start, n: layer_test.ScheduledRequest(  # noqa: E731
        None, n, tables[r], True, start, [100 * r + p for p in range(start, start + n)])
    got, _ = layer_test._run(layer, xs, [part(r, 0, n - 1) for r, n in enumerate(lengths)])  # prefills
    more, meta = layer_test._run(layer, xs, [part(r, n - 1, 1) for r, n in enumerate(lengths)])  # one decode each
    assert len(meta.decode_groups) == 1 and meta.decode_groups[0].block_table.shape == (3, 3)  # padded tables
    got |= more
    for r, n in enumerate(lengths):
        want, counts = layer_test._reference(layer, xs[r], False)
        assert counts[-1] == n  # the decode attended to every token of its context
        torch.testing.assert_close(got[r, n - 1].double(), want[n - 1], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"seed={seed} request {r}: {m}")
