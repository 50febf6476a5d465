"""Triton kernels of paged attention: decode (one query per request) and prefill over a cached prefix.

Legend: D decode requests, P prefill requests, T flat tokens, h query heads,
kvh KV heads, g = h // kvh query heads per KV head (GQA), d head dim,
S decode splits, bs tokens per KV block, N_blocks blocks in the pool.

K/V live in paged caches ``[N_blocks, bs, kvh, d]`` (this step's K/V already
written). Both kernels walk keys BLOCK_N at a time, finding each key's block
through the request's block table (so BLOCK_N need not equal bs), and keep a
running max / normaliser (online softmax) in float32.

Slots a query does not see are never loaded: every K/V load is masked by key position (before the
request's length; in prefill, before the tile's last query and inside the first query's window), with
``other=0``. A reused block keeps an earlier request's values past this one's length, possibly NaN or
inf; a softmax weight of 0 would not cancel them (0 * NaN is NaN), a load that skips them does.

Attention sinks (gpt-oss, HAS_SINKS): one learned logit per query head joins the
softmax's denominator (and attends to nothing); it is folded in once, after the
last key tile (``_fold_sink``), or in the split merge for split decodes.

Imported lazily by ``triton_attention``: ``triton.jit`` decides at decoration
whether kernels are compiled or run in the CPU interpreter (TRITON_INTERPRET=1).
"""

import triton
import triton.language as tl


@triton.jit
def _scores_mask_update(s, visible, m_i, l_i, acc, v, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # One online-softmax step: fold a tile of scores s [R, BLOCK_N] (and values v [BLOCK_N, BLOCK_D]) into
    # the running max m_i [R], normaliser l_i [R] and unnormalised output acc [R, BLOCK_D].
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing visible yet keeps max -inf; shift by 0 then so exp() gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_shift)
    p = tl.exp(s - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if UPCAST:
        pv = tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _kv_tile(k_cache_ptr, v_cache_ptr, table, pos, ok, kv_head, offs_d, d_ok, stride_kb, stride_ks, stride_kh,
             stride_vb, stride_vs, stride_vh, KV_BLOCK: tl.constexpr, UPCAST: tl.constexpr):
    # One KV head's keys and values at positions pos [BLOCK_N], found through the request's block table:
    # -> k, v [BLOCK_N, BLOCK_D] (k in float32 with UPCAST). Positions not ok are never loaded (0).
    blocks = tl.load(table + pos // KV_BLOCK, mask=ok, other=0).to(tl.int64)
    in_block = (pos % KV_BLOCK).to(tl.int64)
    k = tl.load(k_cache_ptr + blocks[:, None] * stride_kb + in_block[:, None] * stride_ks + kv_head * stride_kh
                + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
    v = tl.load(v_cache_ptr + blocks[:, None] * stride_vb + in_block[:, None] * stride_vs + kv_head * stride_vh
                + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    return k, v


@triton.jit
def _fold_sink(m_i, l_i, acc, sink):
    # The sink logit as one more softmax term with no value: rescale to the larger max, add its exp to the sum.
    # -> (normaliser, unnormalised output) sharing that max; a row with no keys gets l = 1 (from the sink), acc 0.
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp(m_i - m_new)
    return l_i * alpha + tl.exp(sink - m_new), acc * alpha[:, None]


# Per-step ints (split count, block-table width) are not specialized on: each new value's divisibility
# would otherwise be a fresh compile in the middle of serving.
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_ml_ptr,
    block_table_ptr, seq_lens_ptr, sinks_ptr,
    scale, window, num_splits,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, KV_BLOCK: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, SLIDING: tl.constexpr, HAS_SINKS: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Grid (D, kvh, S). One program: the g query heads of one KV head of one request, over split S of its keys.

    q [D, h, d], out [D, h, d]; block_table [D, W]; seq_lens [D] (0: a padding row, output 0).
    SPLIT: write unnormalised partial results to part_out [D, h, S, d] and (max, sum) to
    part_ml [D, h, S, 2] for ``paged_decode_reduce_kernel`` (which folds in the sinks [h]); else normalise and
    write out.
    """
    req = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)

    offs_g = tl.arange(0, BLOCK_G)  # query heads of this KV head (rows past GROUP are padding for tl.dot)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + req * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    lo = 0
    if SLIDING:
        lo = tl.maximum(seq_len - window, 0)  # the newest token sees the last `window` positions
    # This split's share of [lo, seq_len), whole BLOCK_N tiles each.
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    table = block_table_ptr + req * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        ok = pos < end
        k, v = _kv_tile(k_cache_ptr, v_cache_ptr, table, pos, ok, kv_head, offs_d, d_ok, stride_kb, stride_ks,
                        stride_kh, stride_vb, stride_vs, stride_vh, KV_BLOCK, UPCAST)  # [BLOCK_N, BLOCK_D] each
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_G, BLOCK_N]
        m_i, l_i, acc = _scores_mask_update(s, ok[None, :], m_i, l_i, acc, v, UPCAST, PRECISION)

    if SPLIT:
        row = (req * (GROUP * tl.num_programs(1)) + heads) * num_splits + split  # [BLOCK_G] index into [D, h, S]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
        tl.store(part_ml_ptr + row * 2, m_i, mask=g_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_ok)
    else:
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + heads, mask=g_ok, other=0.0).to(tl.float32)
            l_i, acc = _fold_sink(m_i, l_i, acc, sink)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a padding row (no keys) writes zeros
        tl.store(out_ptr + req * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def paged_decode_reduce_kernel(
    part_out_ptr, part_ml_ptr, out_ptr, sinks_ptr, num_splits, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Grid (D, h). Merge the S partial results of one query head by their log-sum-exp."""
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    row = (req * tl.num_programs(1) + head) * num_splits + offs_s  # [BLOCK_S]
    m = tl.load(part_ml_ptr + row * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + row * 2 + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m_max = tl.maximum(m_max, sink)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty (a padding row)
    w = tl.exp(m - m_max)  # [BLOCK_S]; 0 for empty splits
    parts = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    total = tl.sum(l * w, 0)
    if HAS_SINKS:
        total += tl.exp(sink - m_max)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)  # [BLOCK_D]
    tl.store(out_ptr + req * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit(do_not_specialize=["stride_bt"])
def paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_table_ptr, seq_lens_ptr, query_start_ptr, query_len_ptr, tile_req_ptr, tile_start_ptr, sinks_ptr,
    scale, window,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, KV_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr, HAS_SINKS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid (tiles, h). One program: BLOCK_M query tokens of one prefill chunk, one query head.

    Chunk p's queries are flat tokens [query_start[p], + query_len[p]) at positions
    [seq_lens[p] - query_len[p], seq_lens[p]): they attend to every cached key before
    the chunk (a prefix-cache hit or earlier chunks) and causally within it.
    tile_req [tiles], tile_start [tiles]: the chunk and first query offset of each tile.
    """
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    req = tl.load(tile_req_ptr + tile).to(tl.int64)
    q0 = tl.load(tile_start_ptr + tile).to(tl.int32)
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    q_len = tl.load(query_len_ptr + req).to(tl.int32)
    first_token = tl.load(query_start_ptr + req).to(tl.int64)

    offs_m = q0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] query offsets within the chunk
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < q_len
    d_ok = offs_d < HEAD_DIM
    q_pos = seq_len - q_len + offs_m  # [BLOCK_M] absolute positions
    rows = first_token + offs_m
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    hi = tl.minimum(seq_len, seq_len - q_len + q0 + BLOCK_M)  # causal: no key past this tile's last query
    lo = 0
    if SLIDING:
        lo = tl.maximum(seq_len - q_len + q0 - window + 1, 0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    table = block_table_ptr + req * stride_bt
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        ok = pos < hi
        k, v = _kv_tile(k_cache_ptr, v_cache_ptr, table, pos, ok, kv_head, offs_d, d_ok, stride_kb, stride_ks,
                        stride_kh, stride_vb, stride_vs, stride_vh, KV_BLOCK, UPCAST)  # [BLOCK_N, BLOCK_D] each
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N]
        visible = ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if SLIDING:
            visible &= pos[None, :] > q_pos[:, None] - window
        m_i, l_i, acc = _scores_mask_update(s, visible, m_i, l_i, acc, v, UPCAST, PRECISION)

    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        l_i, acc = _fold_sink(m_i, l_i, acc, sink + tl.zeros((BLOCK_M,), tl.float32))
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
