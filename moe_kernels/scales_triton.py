"""Reading the float32 scales of 8-bit expert weights inside the Triton kernels (layouts: ``moe_kernels.quant``)."""

import triton
import triton.language as tl


@triton.jit
def scale_cols(scale_ptr, expert, offs_n, n_ok, row0, k_start, stride_se, stride_sn, stride_sk,
               QUANT: tl.constexpr, QBLOCK_N: tl.constexpr, QBLOCK_K: tl.constexpr):
    # -> [BLOCK_N] float32 scales of weight rows offs_n: per channel (QUANT 1), or of the block holding K offset
    # k_start (QUANT 2). row0: the scale row of weight row 0 (the up half of w13 starts its own scales there).
    if QUANT == 1:
        ptrs = scale_ptr + expert * stride_se + (row0 + offs_n) * stride_sn
    else:
        ptrs = (scale_ptr + expert * stride_se + (row0 + offs_n // QBLOCK_N) * stride_sn
                + (k_start // QBLOCK_K) * stride_sk)
    return tl.load(ptrs, mask=n_ok, other=0.0)
