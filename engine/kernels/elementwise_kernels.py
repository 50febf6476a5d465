"""Triton kernels that fuse a layer's small elementwise chains into one launch each.

Legend: T tokens, H hidden, h query heads, kvh KV heads, d head dim (half = d / 2).

A decode step at batch 1 is a few thousand tiny kernels when RMSNorm, the
residual add, q/k norms and RoPE run as separate torch ops; each costs a
launch slot of 1-3 us on the GPU even inside a CUDA graph. These kernels do
each chain in one pass over the row, in float32, rounding where the torch
path rounds (see ``triton_elementwise.py``).

Set ``TRITON_INTERPRET=1`` before this module is first imported to run them
on the CPU (tests).
"""

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,  # x, res [T, H] in; w [H]; out, res_out [T, H] out
    n_cols, eps,
    stride_x, stride_res, stride_out, stride_res_out,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    # One program per row: res_out = x + res (rounded to the dtype, as torch's add), out = rmsnorm(res_out) * w.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    # torch: weight * (x32 * rstd).to(dtype): the normalized row is rounded before the scale.
    y = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def qk_norm_rope_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,  # qkv [T, (h + 2 kvh) d]; cos/sin [P, r] f32; q/k norm w [d]
    num_q_heads, eps, stride_t, stride_cache,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, PASS: tl.constexpr,
    BLOCK_PASS: tl.constexpr, NORM: tl.constexpr,
):
    # Program (t, j): head j of token t, j < h a query head, else key head j - h. q heads then k heads
    # are contiguous columns of the packed projection, so head j starts at column j * d; rewritten in place.
    # The first r = 2 * HALF columns of a head are rotated (NeoX halves); the PASS = d - r after them
    # (partial rotary) are only normalized, when NORM.
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK_HALF)
    ok = cols < HALF
    base = qkv_ptr + t * stride_t + head * HEAD_DIM
    x1 = tl.load(base + cols, mask=ok, other=0.0)  # first half of the rotated part
    x2 = tl.load(base + HALF + cols, mask=ok, other=0.0)  # second half
    dtype = x1.dtype
    if NORM:  # per-head RMSNorm (Qwen3), torch's rounding: weight * (x32 * rstd).to(dtype)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        square_sum = tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)
        if PASS > 0:
            pcols = tl.arange(0, BLOCK_PASS)
            pok = pcols < PASS
            xp = tl.load(base + 2 * HALF + pcols, mask=pok, other=0.0)
            fp = xp.to(tl.float32)
            square_sum += tl.sum(fp * fp, axis=0)
        rstd = tl.rsqrt(square_sum / HEAD_DIM + eps)
        if head < num_q_heads:
            w_ptr = qw_ptr
        else:
            w_ptr = kw_ptr
        w1 = tl.load(w_ptr + cols, mask=ok, other=0.0)
        w2 = tl.load(w_ptr + HALF + cols, mask=ok, other=0.0)
        x1 = ((f1 * rstd).to(dtype).to(tl.float32) * w1.to(tl.float32)).to(dtype)
        x2 = ((f2 * rstd).to(dtype).to(tl.float32) * w2.to(tl.float32)).to(dtype)
        if PASS > 0:
            wp = tl.load(w_ptr + 2 * HALF + pcols, mask=pok, other=0.0)
            tl.store(base + 2 * HALF + pcols, ((fp * rstd).to(dtype).to(tl.float32) * wp.to(tl.float32)).to(dtype),
                     mask=pok)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    # The tables hold cat(freqs, freqs): both halves share one cos/sin. torch casts them to the dtype first.
    c = tl.load(cos_ptr + pos * stride_cache + cols, mask=ok, other=0.0).to(dtype).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_cache + cols, mask=ok, other=0.0).to(dtype).to(tl.float32)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(base + cols, (f1 * c - f2 * s).to(dtype), mask=ok)
    tl.store(base + HALF + cols, (f2 * c + f1 * s).to(dtype), mask=ok)
