"""Matrix-vector kernels for the routed experts at decode sizes (a handful of tokens).

Legend: T tokens, H hidden, I expert intermediate, E experts, k top-k,
S = T*k slots (slot s is token s // k).

At one or two tokens the grouped GEMMs spend most of each tile on padding
rows, and the three launches (two GEMMs and the sum over k) each pay their
ramp-up on a few microseconds of work. Here every program streams a
[BLOCK_N, BLOCK_K] weight tile per step against one activation vector,
keeping float32 partial products per lane and reducing once at the end:

    kernel 1, grid (S, I / BLOCK_N):  inter[s] = act(gate[e] @ x[t] + b_gate[e], up[e] @ x[t] + b_up[e])
    kernel 2, grid (T, H / BLOCK_N):  out[t] = sum_j w[t, j] * (w2[e_j] @ inter[t*k + j] + b2[e_j])

Kernel 2 sums the k experts of its token in a fixed order inside the
program: no [S, H] buffer, no third launch, and the same result every run.
Weights must be contiguous along K (the last dim), as packed checkpoints are.
8-bit weights (QUANT 1: per-channel scales, applied to each row's sum; QUANT 2:
block scales, applied to each BLOCK_K step, which must lie inside one scale
block) are read as such and converted to float32 in registers. MXFP4 weights
(QUANT 3: packed uint8 [E, N, K/2], uint8 scales [E, N, K/32]) are decoded to
float32 a [BLOCK_N, BLOCK_K] tile at a time by ``mxfp4_tile`` (BLOCK_K a
multiple of 32).
"""

import triton
import triton.language as tl

from moe_kernels.activation_triton import gated_act
from moe_kernels.int4_triton import packed4_tile
from moe_kernels.planes_triton import plane_dots
from moe_kernels.scales_triton import scale_cols


@triton.jit
def _k_slice(ptrs, offs_k, k_left, EVEN_K: tl.constexpr):
    # The activation vector's slice at ptrs [BLOCK_K] and k_ok [BLOCK_K]: the positions before K's end (k_left
    # remain), which the weight tile's load masks by too. With EVEN_K the slice is whole: loaded unmasked.
    k_ok = offs_k < k_left
    if EVEN_K:
        v = tl.load(ptrs)
    else:
        v = tl.load(ptrs, mask=k_ok, other=0.0)
    return v, k_ok


@triton.jit
def w13_gemv_kernel(
    x_ptr, w_ptr, ids_ptr, out_ptr, scale_ptr, bias_ptr,  # x [T, H], w13 [E, 2I, H], ids [S] i32, out [S, I],
    top_k, inter_size, hidden_size,                        # scales, bias [E, 2I]
    stride_xt, stride_we, stride_wn, stride_os, stride_se, stride_sn, stride_sk, stride_be, act_alpha, act_limit,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    QUANT: tl.constexpr, QBLOCK_N: tl.constexpr, QBLOCK_K: tl.constexpr, PLANES: tl.constexpr,
):
    slot = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    token = slot // top_k
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] gate rows (up rows are I further)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < inter_size
    if PLANES:  # 4-bit weights as nibble planes (planes_triton): w_ptr holds int32 words
        gate, up = plane_dots(x_ptr + token * stride_xt, w_ptr, scale_ptr, expert, offs_n, inter_size + offs_n,
                              n_ok, hidden_size, stride_we, stride_wn, stride_se, stride_sn, BLOCK_K, EVEN_K, QUANT,
                              True)
    else:
        g_ptrs = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
        u_ptrs = g_ptrs + inter_size * stride_wn
        x_ptrs = x_ptr + token * stride_xt + offs_k
        acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for kk in range(0, tl.cdiv(hidden_size, BLOCK_K)):
            xv, k_ok = _k_slice(x_ptrs, offs_k, hidden_size - kk * BLOCK_K, EVEN_K)  # [BLOCK_K]
            if QUANT >= 3:  # MXFP4 or INT4: [BLOCK_N, BLOCK_K] float32 tiles
                g = packed4_tile(w_ptr, scale_ptr, expert, offs_n, n_ok, kk * BLOCK_K, hidden_size, stride_we,
                                 stride_wn, stride_se, stride_sn, BLOCK_K, EVEN_K, QUANT)
                u = packed4_tile(w_ptr, scale_ptr, expert, inter_size + offs_n, n_ok, kk * BLOCK_K, hidden_size,
                                 stride_we, stride_wn, stride_se, stride_sn, BLOCK_K, EVEN_K, QUANT)
            elif EVEN_K:
                g = tl.load(g_ptrs, mask=n_ok[:, None], other=0.0)
                u = tl.load(u_ptrs, mask=n_ok[:, None], other=0.0)
            else:
                g = tl.load(g_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                u = tl.load(u_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            xf = xv.to(tl.float32)[None, :]
            if QUANT == 2:
                s_g = scale_cols(scale_ptr, expert, offs_n, n_ok, 0, kk * BLOCK_K, stride_se, stride_sn, stride_sk,
                                 QUANT, QBLOCK_N, QBLOCK_K)
                s_u = scale_cols(scale_ptr, expert, offs_n, n_ok, tl.cdiv(inter_size, QBLOCK_N), kk * BLOCK_K,
                                 stride_se, stride_sn, stride_sk, QUANT, QBLOCK_N, QBLOCK_K)
                acc_g += g.to(tl.float32) * s_g[:, None] * xf
                acc_u += u.to(tl.float32) * s_u[:, None] * xf
            else:
                acc_g += g.to(tl.float32) * xf
                acc_u += u.to(tl.float32) * xf
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        gate = tl.sum(acc_g, axis=1)  # [BLOCK_N]
        up = tl.sum(acc_u, axis=1)
        if QUANT == 1:
            gate *= scale_cols(scale_ptr, expert, offs_n, n_ok, 0, 0, stride_se, stride_sn, stride_sk,
                               QUANT, QBLOCK_N, QBLOCK_K)
            up *= scale_cols(scale_ptr, expert, offs_n, n_ok, inter_size, 0, stride_se, stride_sn, stride_sk,
                             QUANT, QBLOCK_N, QBLOCK_K)
    if HAS_BIAS:
        gate += tl.load(bias_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        up += tl.load(bias_ptr + expert * stride_be + inter_size + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    h = gated_act(gate, up, ACTIVATION, act_alpha, act_limit)
    tl.store(out_ptr + slot * stride_os + offs_n, h.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def w2_gemv_sum_kernel(
    h_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, scale_ptr, bias_ptr,  # h [S, I], w2 [E, H, I], ids [S] i32,
    top_k, hidden_size, inter_size,                          # weights [S] f32, out [T, H], scales, bias [E, H]
    stride_hs, stride_we, stride_wn, stride_ot, stride_se, stride_sn, stride_sk, stride_be,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    QUANT: tl.constexpr, QBLOCK_N: tl.constexpr, QBLOCK_K: tl.constexpr, PLANES: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] hidden columns
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < hidden_size
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in range(0, top_k):
        slot = token * top_k + j
        expert = tl.load(ids_ptr + slot).to(tl.int64)
        weight = tl.load(weights_ptr + slot)
        if PLANES:  # 4-bit weights as nibble planes (planes_triton): w_ptr holds int32 words
            row, _ = plane_dots(h_ptr + slot * stride_hs, w_ptr, scale_ptr, expert, offs_n, offs_n, n_ok,
                                inter_size, stride_we, stride_wn, stride_se, stride_sn, BLOCK_K, EVEN_K, QUANT,
                                False)
        else:
            a_ptrs = h_ptr + slot * stride_hs + offs_k
            b_ptrs = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for kk in range(0, tl.cdiv(inter_size, BLOCK_K)):
                a, k_ok = _k_slice(a_ptrs, offs_k, inter_size - kk * BLOCK_K, EVEN_K)  # [BLOCK_K]
                if QUANT >= 3:  # MXFP4 or INT4: a [BLOCK_N, BLOCK_K] float32 tile
                    b = packed4_tile(w_ptr, scale_ptr, expert, offs_n, n_ok, kk * BLOCK_K, inter_size, stride_we,
                                     stride_wn, stride_se, stride_sn, BLOCK_K, EVEN_K, QUANT)
                elif EVEN_K:
                    b = tl.load(b_ptrs, mask=n_ok[:, None], other=0.0)
                else:
                    b = tl.load(b_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                if QUANT == 2:
                    s_b = scale_cols(scale_ptr, expert, offs_n, n_ok, 0, kk * BLOCK_K, stride_se, stride_sn, stride_sk,
                                     QUANT, QBLOCK_N, QBLOCK_K)
                    acc += b.to(tl.float32) * s_b[:, None] * a.to(tl.float32)[None, :]
                else:
                    acc += b.to(tl.float32) * a.to(tl.float32)[None, :]
                a_ptrs += BLOCK_K
                b_ptrs += BLOCK_K
            row = tl.sum(acc, axis=1)
            if QUANT == 1:
                row *= scale_cols(scale_ptr, expert, offs_n, n_ok, 0, 0, stride_se, stride_sn, stride_sk,
                                  QUANT, QBLOCK_N, QBLOCK_K)
        if HAS_BIAS:
            row += tl.load(bias_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        total += weight * row
    tl.store(out_ptr + token * stride_ot + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)
