"""Triton paged attention against the torch path and a float64 loop, on random paged caches.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 is
set here at collection, before anything imports triton), so shapes stay tiny.
Every run draws fresh inputs; the seed is in each assertion message and
ATTN_TEST_SEED=<n> replays one. Outputs are pre-filled with NaN, so a row the
kernels forget to write fails the test.

A step mixes decodes (one new token over a cached context; two of them share
prefix blocks, as after a prefix-cache hit), prefill chunks that start at 0, and
chunks over a cached prefix, one longer than a 64-query tile. gpt-oss's variants:
attention sinks (random per-head logits in the softmax's denominator) and a window
that only some layers have (given to the kernels per call; the torch path reads the
batch's windowed masks).
"""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.worker.batch_builder import build_torch_batch, build_triton_batch, decode_groups  # noqa: E402
from engine.layers.paged_attention import paged_attention  # noqa: E402
from engine.kernels.attention import DEFAULT_LAUNCH, AttentionLaunch, triton_paged_attention  # noqa: E402
from engine.core.request import Request  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402
from engine.core.scheduler import ScheduledRequest  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


@pytest.fixture
def seed() -> int:
    return int(os.environ.get("ATTN_TEST_SEED") or random.SystemRandom().randrange(2**31))


def make_step(rng: random.Random, specs: list[tuple[int, int]], block_size: int, num_blocks: int,
              shared_prefix: tuple[int, int] | None = None) -> list[ScheduledRequest]:
    """One ScheduledRequest per (cached tokens, new tokens), blocks drawn at random from the pool.

    ``shared_prefix=(i, j)``: request j's table starts with request i's full cached blocks.
    """
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for cached, new in specs:
        tables.append([free.pop() for _ in range(-(-(cached + new) // block_size))])
    if shared_prefix is not None:
        i, j = shared_prefix
        num_shared = min(specs[i][0], specs[j][0]) // block_size
        tables[j][:num_shared] = tables[i][:num_shared]
    scheduled = []
    for n, ((cached, new), table) in enumerate(zip(specs, tables)):
        request = Request(f"r{n}", [rng.randrange(100) for _ in range(cached + new)], SamplingParams(), max_tokens=1)
        request.num_computed_tokens = cached
        scheduled.append(ScheduledRequest.of(request, new, table, sample=True))
    return scheduled


def reference_float64(q_rows, k_cache, v_cache, item: ScheduledRequest, scale: float, window: int,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one request's new tokens (q_rows [n, h, d]) in float64, key by key from the block table;
    ``sinks`` [h]: one more logit per head in the softmax, with no value."""
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    group = q_rows.shape[1] // kvh
    start = item.request.num_computed_tokens
    out = torch.empty(q_rows.shape, dtype=torch.float64)
    for j in range(item.num_new_tokens):
        pos = start + j
        keys = [p for p in range(pos + 1) if not window or p > pos - window]
        slots = [item.block_ids[p // bs] * bs + p % bs for p in keys]
        k = k_cache.reshape(-1, kvh, k_cache.shape[-1])[slots].double().cpu()  # [L, kvh, d]
        v = v_cache.reshape(-1, kvh, v_cache.shape[-1])[slots].double().cpu()
        for head in range(q_rows.shape[1]):
            scores = (k[:, head // group] @ q_rows[j, head].double().cpu()) * scale  # [L]
            if sinks is not None:
                scores = torch.cat([scores, sinks[head].double().cpu().view(1)])
            probs = torch.softmax(scores, 0)[:len(keys)]
            out[j, head] = probs @ v[:, head // group]
    return out


def flat_order(scheduled: list[ScheduledRequest], backend: str, window: int) -> list[ScheduledRequest]:
    decodes = [s for s in scheduled if s.num_new_tokens == 1]
    if backend == "torch":
        decodes = [item for group, _ in decode_groups(decodes, window) for item in group]
    return decodes + [s for s in scheduled if s.num_new_tokens > 1]


def run_case(seed: int, specs, *, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
             window: int = 0, splits: int | None = None, shared_prefix=(0, 1),
             launch: AttentionLaunch = DEFAULT_LAUNCH, sinks: bool = False, own_window: bool = False) -> None:
    """``own_window``: the window is the layer's own (gpt-oss), not the batch's."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in specs) + 3
    scheduled = make_step(rng, specs, block_size, num_blocks, shared_prefix)
    # Random values in every slot, used or not: a read through a wrong block changes the result.
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(DEVICE, dtype)
    q_by_request = {id(s): torch.randn(s.num_new_tokens, heads, head_dim, generator=gen).to(DEVICE, dtype) for s in scheduled}
    scale = head_dim**-0.5
    sink_logits = (torch.randn(heads, generator=gen) * 2).to(DEVICE, dtype) if sinks else None  # [h]
    batch_window, layer_window = (0, window) if own_window else (window, None)

    outputs = {}
    for backend in ("triton", "torch"):
        if backend == "triton":
            batch = build_triton_batch(scheduled, block_size, batch_window, kv_heads, DEVICE)
            if splits is not None:
                batch.meta.decode_splits = splits
        else:
            batch = build_torch_batch(scheduled, block_size, batch_window, DEVICE, layer_window)
        order = flat_order(scheduled, backend, window)
        q = torch.cat([q_by_request[id(s)] for s in order])  # [T, h, d]
        if backend == "triton":
            out = torch.full_like(q, float("nan"))
            triton_paged_attention(q, k_cache, v_cache, batch.meta, scale, out=out, launch=launch, sinks=sink_logits,
                                   sliding_window=layer_window)
            assert not out.isnan().any(), f"seed={seed}: rows left unwritten"
        else:
            # The torch path reads this step's own K/V for fresh chunks: the cache holds them already.
            slots = batch.meta.slot_mapping
            k_new, v_new = (c.view(-1, kv_heads, head_dim)[slots] for c in (k_cache, v_cache))  # [T, kvh, d]
            meta = batch.meta.for_window(own_window)
            out = paged_attention(q, k_new, v_new, k_cache, v_cache, meta, scale, sink_logits)
        row = 0
        for item in order:
            outputs.setdefault(id(item), {})[backend] = out[row:row + item.num_new_tokens].double().cpu()
            row += item.num_new_tokens

    tol = TOLERANCE[dtype]
    for item in scheduled:
        ref = reference_float64(q_by_request[id(item)], k_cache, v_cache, item, scale, window, sink_logits)
        got = outputs[id(item)]
        what = f"seed={seed} request {item.request.request_id} (cached {item.request.num_computed_tokens}, new {item.num_new_tokens})"
        torch.testing.assert_close(got["triton"], ref, atol=tol, rtol=tol, msg=lambda m: f"triton vs float64, {what}: {m}")
        torch.testing.assert_close(got["triton"], got["torch"], atol=tol, rtol=tol, msg=lambda m: f"triton vs torch, {what}: {m}")


# (cached tokens, new tokens): decodes (new = 1), a fresh prompt chunk, chunks over a cached prefix.
MIXED_STEP = [(37, 1), (21, 1), (5, 1), (0, 1), (0, 9), (19, 6), (3, 70)]


@pytest.mark.parametrize(("dtype", "heads"), [(torch.float32, 4), (torch.bfloat16, 6)])
def test_mixed_step_matches_torch_and_float64(seed, dtype, heads):
    # GQA with 2 or 3 query heads per KV head, head_dim not a power of two, key tiles spanning 4 blocks.
    run_case(seed, MIXED_STEP, heads=heads, kv_heads=2, head_dim=24, block_size=4, dtype=dtype)


# 16-key decode tiles, so short contexts still spread over several splits.
SMALL_TILES = AttentionLaunch(decode_block_n=16)


@pytest.mark.parametrize("splits", [2, 5])
def test_split_decode_merges_partial_results(seed, splits):
    # Contexts of 3..64 keys over 2 or 5 splits of whole 16-key tiles: some splits get several tiles,
    # some one, some none (the merge must ignore those). All 4 query heads share one KV head.
    run_case(seed, [(40, 1), (2, 1), (17, 1), (63, 1)], heads=4, kv_heads=1, head_dim=16, block_size=8,
             dtype=torch.float32, splits=splits, launch=SMALL_TILES)


def test_sliding_window(seed):
    run_case(seed, [(30, 1), (12, 1), (0, 11), (9, 20)], heads=2, kv_heads=2, head_dim=16, block_size=4,
             dtype=torch.float32, window=7, splits=2, shared_prefix=None, launch=SMALL_TILES)


@pytest.mark.parametrize(("dtype", "heads"), [(torch.float32, 4), (torch.bfloat16, 6)])
def test_sinks_mixed_step(seed, dtype, heads):
    # Decodes sharing prefix blocks (the torch path's shared-prefix merge), fresh and cached prefill chunks.
    run_case(seed, MIXED_STEP, heads=heads, kv_heads=2, head_dim=24, block_size=4, dtype=dtype, sinks=True)


@pytest.mark.parametrize("splits", [1, 3])
def test_sinks_with_split_decode_and_a_layer_window(seed, splits):
    # The sink folded in by the split merge (or by the one program); the window is the layer's own.
    run_case(seed, [(30, 1), (12, 1), (2, 1), (0, 11), (9, 20)], heads=4, kv_heads=2, head_dim=16, block_size=4,
             dtype=torch.float32, window=7, splits=splits, shared_prefix=None, launch=SMALL_TILES, sinks=True,
             own_window=True)
