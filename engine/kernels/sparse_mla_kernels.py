"""Triton kernel of sparse MLA decode: absorbed multi-head latent attention over the selected rows only.

Legend: D decode requests, h query heads, R latent rank, P rotary width, K selected tokens per request (at most),
bs tokens per cache block.

As ``mla_attention_kernels.mla_decode_kernel`` (every head attends to the same latent rows; the key is the whole
``R + P`` row, the value its first R values), but a program walks the request's list of selected positions
(``positions`` [D, K], -1 where fewer were selected) instead of its whole context, so only the selected rows are
read. Imported lazily by ``engine.kernels.sparse_mla``.
"""

import triton
import triton.language as tl

from engine.kernels.attention_kernels import _scores_mask_update
from engine.kernels.mla_attention_kernels import _load_cols


@triton.jit(do_not_specialize=["stride_bt", "stride_pt"])
def sparse_mla_decode_kernel(
    q_ptr, cache_ptr, out_ptr, block_table_ptr, positions_ptr, scale, num_selected,
    stride_qt, stride_qh, stride_cb, stride_cs, stride_ot, stride_oh, stride_bt, stride_pt,
    NUM_HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, KV_BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid (cdiv(h, BLOCK_H), D). One program: BLOCK_H heads of one request over its selected rows.

    q [D, h, R + P], out [D, h, R]; block_table [D, W]; positions [D, K] (token positions, -1: none). A request
    with no position selected writes zeros.
    """
    head_tile = tl.program_id(0)
    req = tl.program_id(1).to(tl.int64)
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

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_R), tl.float32)
    table = block_table_ptr + req * stride_bt
    for n0 in range(0, num_selected, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        pos = tl.load(positions_ptr + req * stride_pt + offs_n, mask=offs_n < num_selected, other=-1)  # [BLOCK_N]
        ok = pos >= 0
        pos = tl.where(ok, pos, 0)
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
        m_i, l_i, acc = _scores_mask_update(s, ok[None, :], m_i, l_i, acc, c_kv, UPCAST, PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + req * stride_ot + heads[:, None] * stride_oh + offs_r[None, :],
             out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & (offs_r < RANK)[None, :])
