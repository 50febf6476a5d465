"""Triton kernels of MLA (multi-head latent attention) decode over a latent paged cache.

Legend: D decode requests, h query heads (this rank's), R latent rank (``kv_lora_rank``),
P rotary width (``qk_rope_head_dim``), S decode splits, bs tokens per cache block.

The cache ``[N_blocks + 1, bs, R + P]`` holds one latent row per token: c_kv (R values)
then k_pe (P values). With the up-projections absorbed into the query, every head
attends to the same rows (one shared KV "head"): the key is the whole row, the value
its first R values. So one program takes a tile of BLOCK_H heads of one request and
loads each tile of BLOCK_N rows once for all of them: the scores are two tl.dot's
(the R part and the P part, so R + P need not be one power of two) and the values
are the c_kv part of the rows already loaded.
As in ``attention_kernels``, only rows before the request's length are loaded (masked loads, ``other=0``): the
stale rows a reused block holds past it never enter a sum, whatever they hold.

Imported lazily by ``mla_attention``: ``triton.jit`` decides at decoration whether
kernels are compiled or run in the CPU interpreter (TRITON_INTERPRET=1).
"""

import triton
import triton.language as tl

from engine.kernels.attention_kernels import _scores_mask_update


@triton.jit
def _split_range(seq_len, split, num_splits, BLOCK_N: tl.constexpr):
    # Split `split` of a request's keys [0, seq_len): whole BLOCK_N tiles each; splits past the context get an
    # empty range. Also returns the split length, never 0, so the merge can count the splits that hold keys.
    per_split = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N, BLOCK_N)
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    return start, end, per_split


@triton.jit
def _load_cols(ptrs, row_ok, offs, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    # A [rows, BLOCK] tile whose columns past WIDTH read 0. When WIDTH fills the tile the mask stays
    # constant along the contiguous dimension, so the load keeps its vector width.
    if WIDTH == BLOCK:
        return tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        return tl.load(ptrs, mask=row_ok[:, None] & (offs < WIDTH)[None, :], other=0.0)


@triton.jit
def _query_tile(q_ptr, req, head_tile, stride_qt, stride_qh, NUM_HEADS: tl.constexpr, RANK: tl.constexpr,
                ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                UPCAST: tl.constexpr):
    # One request's tile of BLOCK_H heads -> (heads, which are real, the R and P column offsets, its latent part
    # [BLOCK_H, BLOCK_R] and rope part [BLOCK_H, BLOCK_P], float32 where UPCAST).
    heads = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H] (rows past h are padding for tl.dot)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    h_ok = heads < NUM_HEADS
    q_rows = q_ptr + req * stride_qt + heads[:, None] * stride_qh
    q_nope = _load_cols(q_rows + offs_r[None, :], h_ok, offs_r, RANK, BLOCK_R)  # [BLOCK_H, BLOCK_R]
    q_pe = _load_cols(q_rows + RANK + offs_p[None, :], h_ok, offs_p, ROPE, BLOCK_P)  # [BLOCK_H, BLOCK_P]
    if UPCAST:
        q_nope = q_nope.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    return heads, h_ok, offs_r, offs_p, q_nope, q_pe


@triton.jit
def _latent_scores(cache_ptr, table, pos, ok, q_nope, q_pe, scale, stride_cb, stride_cs, offs_r, offs_p,
                   RANK: tl.constexpr, ROPE: tl.constexpr, KV_BLOCK: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_P: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # The latent rows of token positions pos [BLOCK_N] (ok: which to read; the rest read 0) through a request's
    # block table -> (scores [BLOCK_H, BLOCK_N] of the query tile against them, their c_kv [BLOCK_N, BLOCK_R]:
    # the values).
    blocks = tl.load(table + pos // KV_BLOCK, mask=ok, other=0).to(tl.int64)
    rows = cache_ptr + blocks[:, None] * stride_cb + (pos % KV_BLOCK).to(tl.int64)[:, None] * stride_cs
    c_kv = _load_cols(rows + offs_r[None, :], ok, offs_r, RANK, BLOCK_R)  # [BLOCK_N, BLOCK_R]: keys and values
    k_pe = _load_cols(rows + RANK + offs_p[None, :], ok, offs_p, ROPE, BLOCK_P)  # [BLOCK_N, BLOCK_P]
    if UPCAST:
        k_pe = k_pe.to(tl.float32)
        s = tl.dot(q_nope, tl.trans(c_kv.to(tl.float32)), input_precision=PRECISION)
    else:
        s = tl.dot(q_nope, tl.trans(c_kv), input_precision=PRECISION)
    s = tl.dot(q_pe, tl.trans(k_pe), acc=s, input_precision=PRECISION) * scale  # [BLOCK_H, BLOCK_N]
    return s, c_kv


# Per-step ints (split count, block-table width) are not specialized on: each new value's divisibility
# would otherwise be a fresh compile in the middle of serving.
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def mla_decode_kernel(
    q_ptr, cache_ptr, out_ptr, part_out_ptr, part_ml_ptr, block_table_ptr, seq_lens_ptr,
    scale, num_splits,
    stride_qt, stride_qh, stride_cb, stride_cs, stride_ot, stride_oh, stride_bt,
    NUM_HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, KV_BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid (cdiv(h, BLOCK_H), S, D). One program: BLOCK_H heads of one request over split S of its keys.

    q [D, h, R + P], out [D, h, R]; block_table [D, W]; seq_lens [D] (0: a padding row, output 0).
    Head tiles are the fastest grid axis, so the programs that read the same rows are launched
    together and can share them through L2.
    SPLIT: write unnormalised partial results to part_out [D, h, S, R] and (max, sum) to
    part_ml [D, h, S, 2] for ``mla_merge_kernel`` (splits past the context write nothing);
    else normalise and write out.
    """
    head_tile = tl.program_id(0)
    split = tl.program_id(1)
    req = tl.program_id(2).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)

    heads, h_ok, offs_r, offs_p, q_nope, q_pe = _query_tile(q_ptr, req, head_tile, stride_qt, stride_qh, NUM_HEADS,
                                                            RANK, ROPE, BLOCK_H, BLOCK_R, BLOCK_P, UPCAST)

    start, end, per_split = _split_range(seq_len, split, num_splits, BLOCK_N)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_R), tl.float32)
    table = block_table_ptr + req * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        ok = pos < end
        s, c_kv = _latent_scores(cache_ptr, table, pos, ok, q_nope, q_pe, scale, stride_cb, stride_cs, offs_r, offs_p,
                                 RANK, ROPE, KV_BLOCK, BLOCK_R, BLOCK_P, UPCAST, PRECISION)
        m_i, l_i, acc = _scores_mask_update(s, ok[None, :], m_i, l_i, acc, c_kv, UPCAST, PRECISION)

    if SPLIT:
        # A split past the context leaves its slot unwritten: the merge never reads it.
        live = h_ok & (start + tl.zeros((BLOCK_H,), tl.int32) < end)  # [BLOCK_H]
        row = (req * NUM_HEADS + heads) * num_splits + split  # [BLOCK_H] index into [D, h, S]
        tl.store(part_out_ptr + row[:, None] * RANK + offs_r[None, :], acc, mask=live[:, None] & (offs_r < RANK)[None, :])
        tl.store(part_ml_ptr + row * 2, m_i, mask=live)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=live)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a padding row (no keys) writes zeros
        tl.store(out_ptr + req * stride_ot + heads[:, None] * stride_oh + offs_r[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & (offs_r < RANK)[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def mla_merge_kernel(
    part_out_ptr, part_ml_ptr, out_ptr, seq_lens_ptr, num_splits, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (h, D). Merge the partial results of one head by their log-sum-exp, one split at a time.

    Only the splits that hold keys are read (as ``mla_decode_kernel`` drew them), so the count of
    splits can be large (a long context at batch 1) without a [S, R] tile in registers; a padding
    row (no keys) writes zeros.
    """
    head = tl.program_id(0)
    req = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    _, _, per_split = _split_range(seq_len, 0, num_splits, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < RANK
    m = float("-inf")
    total = 0.0
    acc = tl.zeros((BLOCK_R,), tl.float32)
    base = (req * NUM_HEADS + head) * num_splits
    for split in range(0, tl.cdiv(seq_len, per_split)):
        m_s = tl.load(part_ml_ptr + (base + split) * 2)
        l_s = tl.load(part_ml_ptr + (base + split) * 2 + 1)
        part = tl.load(part_out_ptr + (base + split) * RANK + offs_r, mask=r_ok, other=0.0)  # [BLOCK_R]
        m_new = tl.maximum(m, m_s)  # finite: a split that holds keys has a finite max
        alpha = tl.exp(m - m_new)
        beta = tl.exp(m_s - m_new)
        total = total * alpha + l_s * beta
        acc = acc * alpha + part * beta
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + req * stride_ot + head * stride_oh + offs_r, out.to(out_ptr.dtype.element_ty), mask=r_ok)
