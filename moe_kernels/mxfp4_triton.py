"""Reading MXFP4 expert weights inside the Triton kernels (layout: ``moe_kernels.mxfp4``).

A tile is BLOCK_N weight rows by BLOCK_K values along K, BLOCK_K a multiple of 32 (whole scale groups). It is
read as its packed bytes [BLOCK_N, BLOCK_K/32, 16] and its scale bytes [BLOCK_N, BLOCK_K/32], each byte once and
contiguous along K, and decoded with a handful of integer ops and two multiplies per value:

- a nibble's e2m1 code (sign s, exponent bits ee, mantissa bit m) is moved to float32 bit positions: s to bit 31,
  ee m to bits 24..22 (float32's two lowest exponent bits and its top mantissa bit). That float32 is the e2m1 value
  times 2**-126 exactly: ee = 0, e2m1's subnormal m/2, lands on float32's subnormals 0.m * 2**-126, and ee > 0,
  (1 + m/2) * 2**(ee - 1), on (1 + m/2) * 2**(ee - 127). No select, no exp2.
- times 2**126, then times the group's 2**(scale - 127), built from the scale byte's bits (scale 0 is float32's
  subnormal 2**-127). Each product is a 2-bit significand times a power of two: exact wherever float32 holds the
  weight (every scale up to 252; above, the largest codes overflow to inf, as in ``dequantize_mxfp4``).

The low and high nibbles (even and odd K) are decoded as two [BLOCK_N, BLOCK_K/32, 16] halves and interleaved.
"""

import triton
import triton.language as tl


@triton.jit
def _e2m1_scaled(code_at_top, scale):
    # int32 whose bits 31..28 are an e2m1 code (sign first; lower bits ignored) -> float32 e2m1(code) * scale.
    # The arithmetic shift puts ee m at bits 24..22 and copies the sign into bits 31..25; the mask
    # (0x81C00000 as an int32) keeps bit 31 and bits 24..22: float32 e2m1(code) * 2**-126.
    placed = ((code_at_top >> 6) & -0x7E400000).to(tl.float32, bitcast=True)
    return placed * 8.507059173023462e37 * scale  # 2.0**126: e2m1(code) exactly, then the group's scale


@triton.jit
def scale_groups(n_ok, k_start, k_size, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    # A 4-bit tile's groups of 32 along K: their scale columns [BLOCK_K/32] and which [BLOCK_N, BLOCK_K/32] of them
    # to read (rows where n_ok, groups before k_size; with EVEN_K every group is inside K). k_start and k_size are
    # multiples of 32: a group lies wholly inside K or past it.
    GROUPS: tl.constexpr = BLOCK_K // 32
    group = k_start // 32 + tl.arange(0, GROUPS)  # [GROUPS]
    ok = n_ok[:, None]  # [BLOCK_N, 1]
    if not EVEN_K:
        ok = ok & (group < k_size // 32)[None, :]  # [BLOCK_N, GROUPS]
    return group, ok


@triton.jit
def mxfp4_tile(w_ptr, scale_ptr, expert, rows, n_ok, k_start, k_size, stride_we, stride_wn, stride_se, stride_sn,
               BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    # -> [BLOCK_N, BLOCK_K] float32 W[expert, rows, k_start : k_start + BLOCK_K], zero for rows where n_ok is
    # False and for K past k_size (not read when EVEN_K: k_size is a multiple of BLOCK_K).
    # w_ptr: packed uint8 [E, N, K/2], scale_ptr: uint8 [E, N, K/32], both contiguous along K;
    # k_start and k_size multiples of 32.
    group, ok = scale_groups(n_ok, k_start, k_size, BLOCK_K, EVEN_K)  # [GROUPS] scale columns, [BLOCK_N, GROUPS]
    # 16 bytes hold a group's 32 values: byte j of group g, values 32g + 2j (low nibble) and 32g + 2j + 1 (high).
    byte_ptrs = (w_ptr + expert * stride_we + rows[:, None, None] * stride_wn + group[None, :, None] * 16
                 + tl.arange(0, 16)[None, None, :])  # [BLOCK_N, GROUPS, 16]
    packed = tl.load(byte_ptrs, mask=ok[:, :, None], other=0).to(tl.int32)  # masked: code 0, +0.0
    s = tl.load(scale_ptr + expert * stride_se + rows[:, None] * stride_sn + group[None, :], mask=ok,
                other=127).to(tl.int32)  # [BLOCK_N, GROUPS]
    # 2**(s - 127): the byte as float32 exponent bits; s = 0 (2**-127) is the subnormal with mantissa bit 22 set.
    scale = tl.where(s == 0, 0x400000, s << 23).to(tl.float32, bitcast=True)[:, :, None]
    low = _e2m1_scaled(packed << 28, scale)  # [BLOCK_N, GROUPS, 16]: even K
    high = _e2m1_scaled(packed << 24, scale)  # odd K
    return tl.reshape(tl.interleave(low, high), (rows.shape[0], BLOCK_K))
