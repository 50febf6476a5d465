"""4-bit expert weights as nibble planes: the matrix-vector kernels' decode that never interleaves.

Legend: BLOCK_N weight rows, BLOCK_K values along K (a multiple of 32, whole scale groups), G = BLOCK_K / 32.

MXFP4's packed bytes read as little-endian int32 words hold their values exactly as INT4's words do
(``moe_kernels.mxfp4``, ``moe_kernels.int4``): word q of group g (four words a group) holds values 32g + 8q + i in
bits 4i..4i+3, i = 0..7. A step reads its [BLOCK_N, G, 4] words (16 bytes per group, each once) and its scales
[BLOCK_N, G], and takes nibble i of every word as plane i: a [BLOCK_N, G, 4] tile of weights elementwise on the
words, against the activation's plane [G, 4] (x[32g + 8q + i]). A dot product does not care in which order K is
summed, so the planes are never put back into K order: no interleave, no reshape, every tile in the words' own
layout, and one accumulator per word position carries all eight planes (a chain of fused multiply-adds).

Per value, MXFP4 takes a shift, an arithmetic shift and a mask (``mxfp4_tile``'s float32 subnormal trick: the code
lands as e2m1 * 2**-126), one multiply by the folded scale S1 = 2**126 * 2**(min(s, 128) - 127) and the
multiply-add into the accumulator; S1 is a float32 for every e8m0 byte s up to 128, and the rest of a larger scale,
R = 2**(max(s, 128) - 128), multiplies the step's eight-plane sum once per word (1.0 for every scale up to 128,
all of gpt-oss's). Each weight times S1 is exact, each factor a power of two: the sums are those of a float32
matrix-vector product over ``dequantize_mxfp4``'s weights wherever they are finite (scales up to 252), only
summed in another order. INT4 takes each nibble by a mask (the top three after a shift) into the mantissa of a
float32 power of two (the mask and the exponent in one op, no int-to-float conversion), less that power plus 8,
times the scale, rounded to bfloat16 as ``int4_tile`` rounds (bfloat16 scales).
"""

import triton
import triton.language as tl

from moe_kernels.mxfp4_triton import scale_groups

WORDS_PER_GROUP = tl.constexpr(4)  # int32 words a group of 32 values takes
PLANES = tl.constexpr(8)  # nibbles an int32 word holds


@triton.jit
def plane_words(w_ptr, expert, rows, n_ok, k_start, k_size, stride_we, stride_wn, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr):
    # -> words [BLOCK_N, G, 4] int32 of W[expert, rows, k_start : k_start + BLOCK_K] (0 where not ok), group [G]
    # (the scale columns) and ok [BLOCK_N, G] (rows where n_ok, groups inside K).
    # w_ptr: int32 words [E, N, K/8] (MXFP4's bytes viewed as int32, or INT4's words), contiguous along K.
    group, ok = scale_groups(n_ok, k_start, k_size, BLOCK_K, EVEN_K)
    word_ptrs = (w_ptr + expert * stride_we + rows[:, None, None] * stride_wn + group[None, :, None] * WORDS_PER_GROUP
                 + tl.arange(0, WORDS_PER_GROUP)[None, None, :])  # [BLOCK_N, G, 4]
    if EVEN_K:
        words = tl.load(word_ptrs, mask=n_ok[:, None, None], other=0)
    else:
        words = tl.load(word_ptrs, mask=ok[:, :, None], other=0)
    return words, group, ok


@triton.jit
def plane_scales(scale_ptr, expert, rows, group, ok, stride_se, stride_sn, QUANT: tl.constexpr):
    # -> (a, b) float32 [BLOCK_N, G, 1]. MXFP4 (QUANT 3, uint8 e8m0 scales s): a = S1 = 2**(min(s, 128) - 1),
    # which times a nibble's float32 placement (e2m1 * 2**-126) gives e2m1 * 2**(min(s, 128) - 127), and
    # b = R = 2**(max(s, 128) - 128), the rest of the scale (both powers of two). INT4 (QUANT 4, bfloat16 or float32
    # scales): a = the scale, b = 1.
    ptrs = scale_ptr + expert * stride_se + rows[:, None] * stride_sn + group[None, :]  # [BLOCK_N, G]
    if QUANT == 3:
        s = tl.load(ptrs, mask=ok, other=127).to(tl.int32)
        # Float32 exponent fields: min(s, 128) + 126 is 126..254, max(s, 128) - 1 is 127..253: no subnormal, no inf.
        a = ((tl.minimum(s, 128) + 126) << 23).to(tl.float32, bitcast=True)
        b = ((tl.maximum(s, 128) - 1) << 23).to(tl.float32, bitcast=True)
    else:
        a = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)  # masked words decode to -8: times 0, -0.0
        b = tl.full(a.shape, 1.0, tl.float32)
    return a[:, :, None], b[:, :, None]


@triton.jit
def plane_values(words, i: tl.constexpr, a, QUANT: tl.constexpr, ROUND_BF16: tl.constexpr):
    # Plane i of the words [BLOCK_N, G, 4] int32 as float32 weights: MXFP4 W / R, INT4 W (see ``plane_scales``).
    if QUANT == 3:
        # Nibble i's sign to bit 31 (no shift for the top nibble), then the arithmetic shift puts ee m at bits
        # 24..22 and copies the sign over bits 30..25, which the mask (0x81C00000) clears: e2m1 * 2**-126.
        if i == PLANES - 1:
            top = words
        else:
            top = words << (28 - 4 * i)
        values = ((top >> 6) & -0x7E400000).to(tl.float32, bitcast=True) * a
    else:
        # The stored nibble c, left where it is (nibbles 0..4; 5..7 shifted to bits 16..19), as the mantissa bits of
        # the float32 2**(23 - pos) + c (mask and exponent in one op), less 2**(23 - pos) + 8: the integer c - 8.
        if i <= 4:
            pos: tl.constexpr = 4 * i
            field = words
        else:
            pos: tl.constexpr = 16
            field = words >> (4 * i - 16)
        magic = ((field & (0xF << pos)) | ((150 - pos) << 23)).to(tl.float32, bitcast=True)
        q = magic - ((1 << (23 - pos)) + 8)
        values = q * a  # exact: 4 bits times a bfloat16 (or float32 scale: one rounding, as dequantize_int4's)
        if ROUND_BF16:
            # To bfloat16, to nearest even, with integer ops (the interpreter's float32 -> bfloat16 cast truncates).
            bits = values.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536: 0xFFFF0000, the bfloat16 bits kept
            values = bits.to(tl.float32, bitcast=True)
    return values


@triton.jit
def x_plane(x_ptr, i: tl.constexpr, k_start, k_size, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    # -> [G, 4] float32 activation plane i of the step at k_start: x[k_start + 32g + 8q + i] (0 past k_size).
    # x_ptr points at the activation row's element 0, contiguous along K.
    group = tl.arange(0, BLOCK_K // 32)
    offs = k_start + group[:, None] * 32 + tl.arange(0, WORDS_PER_GROUP)[None, :] * PLANES + i
    if EVEN_K:
        v = tl.load(x_ptr + offs)
    else:
        v = tl.load(x_ptr + offs, mask=(k_start + group * 32 < k_size)[:, None], other=0.0)
    return v.to(tl.float32)


@triton.jit
def _plane_step(acc_a, acc_b, x_ptr, w_ptr, scale_ptr, expert, rows_a, rows_b, n_ok, k_start, k_size, stride_we,
                stride_wn, stride_se, stride_sn, BLOCK_K: tl.constexpr, WHOLE: tl.constexpr, QUANT: tl.constexpr,
                TWO: tl.constexpr, ROUND_BF16: tl.constexpr):
    # acc_a, acc_b [BLOCK_N, G, 4] plus the step at k_start (WHOLE: inside K, nothing masked along K).
    words_a, group, ok = plane_words(w_ptr, expert, rows_a, n_ok, k_start, k_size, stride_we, stride_wn, BLOCK_K,
                                     WHOLE)  # [BLOCK_N, G, 4]
    s1_a, r_a = plane_scales(scale_ptr, expert, rows_a, group, ok, stride_se, stride_sn, QUANT)  # [BLOCK_N, G, 1]
    if TWO:
        words_b, group, ok = plane_words(w_ptr, expert, rows_b, n_ok, k_start, k_size, stride_we, stride_wn, BLOCK_K,
                                         WHOLE)
        s1_b, r_b = plane_scales(scale_ptr, expert, rows_b, group, ok, stride_se, stride_sn, QUANT)
    # MXFP4 sums the step's planes apart, to multiply the sum by R once; INT4 adds into the accumulator.
    if QUANT == 3:
        step_a = tl.zeros_like(acc_a)
        step_b = tl.zeros_like(acc_b)
    else:
        step_a = acc_a
        step_b = acc_b
    for i in tl.static_range(PLANES):
        xi = x_plane(x_ptr, i, k_start, k_size, BLOCK_K, WHOLE)[None, :, :]  # [1, G, 4]
        step_a += plane_values(words_a, i, s1_a, QUANT, ROUND_BF16) * xi
        if TWO:
            step_b += plane_values(words_b, i, s1_b, QUANT, ROUND_BF16) * xi
    if QUANT == 3:
        acc_a += step_a * r_a
        if TWO:
            acc_b += step_b * r_b
    else:
        acc_a = step_a
        acc_b = step_b
    return acc_a, acc_b


@triton.jit
def plane_dots(x_ptr, w_ptr, scale_ptr, expert, rows_a, rows_b, n_ok, k_size, stride_we, stride_wn, stride_se,
               stride_sn, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, QUANT: tl.constexpr, TWO: tl.constexpr):
    # -> (a, b) [BLOCK_N] float32: W[expert, rows_a] @ x and, with TWO, W[expert, rows_b] @ x (else zeros), the
    # two sharing each activation plane. Rows where n_ok is False sum to 0. x_ptr: the activation row (K values),
    # w_ptr: int32 words [E, N, K/8], scale_ptr: [E, N, K/32] (QUANT 3: uint8 e8m0, 4: bfloat16 or float32).
    # The whole steps run unmasked along K; without EVEN_K the last, partial step follows on its own.
    GROUPS: tl.constexpr = BLOCK_K // 32
    ROUND_BF16: tl.constexpr = QUANT == 4 and scale_ptr.dtype.element_ty == tl.bfloat16
    acc_a = tl.zeros((rows_a.shape[0], GROUPS, WORDS_PER_GROUP), dtype=tl.float32)  # per word position
    acc_b = tl.zeros((rows_a.shape[0], GROUPS, WORDS_PER_GROUP), dtype=tl.float32)
    whole = k_size // BLOCK_K
    for kk in range(0, whole):
        acc_a, acc_b = _plane_step(acc_a, acc_b, x_ptr, w_ptr, scale_ptr, expert, rows_a, rows_b, n_ok, kk * BLOCK_K,
                                   k_size, stride_we, stride_wn, stride_se, stride_sn, BLOCK_K, True, QUANT, TWO,
                                   ROUND_BF16)
    if not EVEN_K:
        acc_a, acc_b = _plane_step(acc_a, acc_b, x_ptr, w_ptr, scale_ptr, expert, rows_a, rows_b, n_ok,
                                   whole * BLOCK_K, k_size, stride_we, stride_wn, stride_se, stride_sn, BLOCK_K, False,
                                   QUANT, TWO, ROUND_BF16)
    return tl.sum(tl.sum(acc_a, axis=2), axis=1), tl.sum(tl.sum(acc_b, axis=2), axis=1)
