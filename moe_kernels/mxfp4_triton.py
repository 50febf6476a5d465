"""Reading MXFP4 expert weights inside the Triton kernels (layout: ``moe_kernels.mxfp4``)."""

import triton
import triton.language as tl


@triton.jit
def mxfp4_tile(w_ptr, scale_ptr, expert, rows, n_ok, offs_k, k_ok, stride_we, stride_wn, stride_se, stride_sn):
    # -> [BLOCK_K, BLOCK_N] float32 weight values W[expert, rows, offs_k], zero where masked.
    # w_ptr: packed uint8 [E, N, K/2] (contiguous along K), scale_ptr: uint8 [E, N, K/32] (contiguous along K).
    ok = k_ok[:, None] & n_ok[None, :]
    byte = tl.load(w_ptr + expert * stride_we + rows[None, :] * stride_wn + (offs_k // 2)[:, None], mask=ok, other=0)
    code = (byte.to(tl.int32) >> ((offs_k % 2) * 4)[:, None]) & 0xF  # even k: low nibble, odd k: high
    exp_bits = (code >> 1) & 3
    mant = (code & 1).to(tl.float32)
    # e2m1: subnormal m * 0.5 when the exponent bits are 0, else (1 + m/2) * 2**(e - 1) = (2 + m) * 2**(e - 2).
    value = tl.where(exp_bits == 0, mant * 0.5, (2.0 + mant) * tl.exp2((exp_bits - 2).to(tl.float32)))
    value = tl.where(code >= 8, -value, value)
    s = tl.load(scale_ptr + expert * stride_se + rows[None, :] * stride_sn + (offs_k // 32)[:, None], mask=ok,
                other=127)
    return value * tl.exp2(s.to(tl.float32) - 127.0)
