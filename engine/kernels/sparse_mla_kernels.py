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
from engine.kernels.mla_attention_kernels import _latent_scores, _query_tile


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
    heads, h_ok, offs_r, offs_p, q_nope, q_pe = _query_tile(q_ptr, req, head_tile, stride_qt, stride_qh, NUM_HEADS,
                                                            RANK, ROPE, BLOCK_H, BLOCK_R, BLOCK_P, UPCAST)

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_R), tl.float32)
    table = block_table_ptr + req * stride_bt
    for n0 in range(0, num_selected, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        pos = tl.load(positions_ptr + req * stride_pt + offs_n, mask=offs_n < num_selected, other=-1)  # [BLOCK_N]
        ok = pos >= 0
        pos = tl.where(ok, pos, 0)
        s, c_kv = _latent_scores(cache_ptr, table, pos, ok, q_nope, q_pe, scale, stride_cb, stride_cs, offs_r, offs_p,
                                 RANK, ROPE, KV_BLOCK, BLOCK_R, BLOCK_P, UPCAST, PRECISION)
        m_i, l_i, acc = _scores_mask_update(s, ok[None, :], m_i, l_i, acc, c_kv, UPCAST, PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + req * stride_ot + heads[:, None] * stride_oh + offs_r[None, :],
             out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & (offs_r < RANK)[None, :])
