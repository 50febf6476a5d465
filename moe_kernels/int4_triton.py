"""Reading INT4 expert weights inside the Triton kernels (layout: ``moe_kernels.int4``).

A tile is BLOCK_N weight rows by BLOCK_K values along K, BLOCK_K a multiple of 32 (whole scale groups). It is read
as its packed words [BLOCK_N, BLOCK_K/32, 4] (four int32 words hold a group's 32 values) and its scales
[BLOCK_N, BLOCK_K/32], each once and contiguous along K. Each word's eight nibbles are shifted out, less 8 (the
stored offset), times the group's scale in float32 (exact: a 4-bit integer times a bfloat16 or float32 scale), then
rounded to the scale's dtype as ``dequantize_int4`` does (to nearest even), so the tile is the torch path's weight
bit for bit.
"""

import triton
import triton.language as tl

from moe_kernels.mxfp4_triton import mxfp4_tile, scale_groups


@triton.jit
def int4_tile(w_ptr, scale_ptr, expert, rows, n_ok, k_start, k_size, stride_we, stride_wn, stride_se, stride_sn,
              BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    # -> [BLOCK_N, BLOCK_K] float32 W[expert, rows, k_start : k_start + BLOCK_K], zero for rows where n_ok is
    # False and for K past k_size (not read when EVEN_K: k_size is a multiple of BLOCK_K).
    # w_ptr: int32 [E, N, K/8], scale_ptr: [E, N, K/32] bfloat16 or float32, both contiguous along K;
    # k_start and k_size multiples of 32.
    group, ok = scale_groups(n_ok, k_start, k_size, BLOCK_K, EVEN_K)  # [GROUPS] scale columns, [BLOCK_N, GROUPS]
    # Word j of group g holds values 32g + 8j .. 32g + 8j + 7, value 32g + 8j + i in bits 4i..4i+3.
    word_ptrs = (w_ptr + expert * stride_we + rows[:, None, None] * stride_wn + group[None, :, None] * 4
                 + tl.arange(0, 4)[None, None, :])  # [BLOCK_N, GROUPS, 4]
    words = tl.load(word_ptrs, mask=ok[:, :, None], other=0)  # masked: scale 0 below makes them +0.0
    scale = tl.load(scale_ptr + expert * stride_se + rows[:, None] * stride_sn + group[None, :], mask=ok,
                    other=0.0)  # [BLOCK_N, GROUPS]
    shifts = tl.arange(0, 8) * 4  # [8]
    nibbles = (words[:, :, :, None] >> shifts[None, None, None, :]) & 0xF  # [BLOCK_N, GROUPS, 4, 8]
    values = (nibbles - 8).to(tl.float32) * scale.to(tl.float32)[:, :, None, None]
    if scale_ptr.dtype.element_ty == tl.bfloat16:
        # Rounded to bfloat16 as compressed-tensors' product is: to nearest, ties to even, with integer ops on the
        # float32 bits (the interpreter's float32 -> bfloat16 cast truncates instead). Values are finite.
        bits = values.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536: 0xFFFF0000, the bfloat16 bits kept
        values = bits.to(tl.float32, bitcast=True)
    return tl.reshape(values, (rows.shape[0], BLOCK_K))


@triton.jit
def packed4_tile(w_ptr, scale_ptr, expert, rows, n_ok, k_start, k_size, stride_we, stride_wn, stride_se, stride_sn,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, QUANT: tl.constexpr):
    # A 4-bit weight tile [BLOCK_N, BLOCK_K] float32: MXFP4 (QUANT 3, ``mxfp4_tile``) or INT4 (QUANT 4, ``int4_tile``).
    if QUANT == 3:
        tile = mxfp4_tile(w_ptr, scale_ptr, expert, rows, n_ok, k_start, k_size, stride_we, stride_wn, stride_se,
                          stride_sn, BLOCK_K, EVEN_K)
    else:
        tile = int4_tile(w_ptr, scale_ptr, expert, rows, n_ok, k_start, k_size, stride_we, stride_wn, stride_se,
                         stride_sn, BLOCK_K, EVEN_K)
    return tile
