"""Triton backend: two grouped GEMMs over expert-sorted token slots.

Legend: T tokens, H hidden, I expert intermediate, E experts, k top-k,
S = T*k slots (slot s is token s // k, its (s % k)-th expert), P padded rows.

    x [T, H] --kernel 1: rows x[slot // k] @ w13[e]^T, act(gate) * up--> inter [S, I]
    inter [S, I] --kernel 2: @ w2[e]^T, * topk_weight[slot]--> slot_out [S, H]
    slot_out viewed [T, k, H] --sum over k (torch)--> out [T, H]

Each program owns one block of BLOCK_M rows (all of one expert, see
``align.py``) and one BLOCK_N column tile, and loops over the reduction dim in
BLOCK_K steps, accumulating in float32.

8-bit weights (float8_e4m3fn or int8, ``moe_kernels.quant``) are loaded as
such and converted to the activation dtype in registers before each dot
(weight-only: activations are never quantized). Per-channel scales multiply
the float32 accumulator's columns once, after the K loop; block scales
multiply each K step's partial product (BLOCK_K is cut to divide the scale
block, so a K step never straddles two scale blocks).

MXFP4 weights (``moe_kernels.mxfp4``: packed uint8 nibbles and uint8 e8m0
scales, one per 32 values along K) are dequantized tile by tile in registers
(``mxfp4_tile``: each packed byte and scale byte read once, the nibbles turned
into float32 with integer ops and two multiplies, exactly), converted to the
activation dtype (exact) and multiplied as float weights. A tile then holds
whole scale groups: BLOCK_K must be a multiple of 32 (looked-up configs are
raised to it; a config passed in that is not is refused).

With ``GemmConfig.SWAP`` MXFP4 weights take the swapped-operand kernels
instead (``moe_kernels.swapped_triton``: the decoded weight tile as the dot's
first operand, the block's slots as its N; ``SPLIT_K`` cuts K across programs
and adds their float32 partial sums in a second, fixed-order pass).

INT4 weights (``moe_kernels.int4``: packed int32 words of eight signed
nibbles and bfloat16 scales, one per 32 values along K: the compressed-tensors
layout of Kimi's published experts) take the same road (``int4_tile``): the
kernels are W4A16, activations stay in their dtype.

Set ``TRITON_INTERPRET=1`` before this module is first imported to run the
kernels on the CPU (tests): ``triton.jit`` picks compiled or interpreted at
decoration time.
"""

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from moe_kernels import gemv_kernels, swapped_triton
from moe_kernels.activation import SILU, ExpertActivation
from moe_kernels.activation_triton import gated_act
from moe_kernels.scales_triton import scale_cols
from moe_kernels.int4_triton import packed4_tile
from moe_kernels.blocks_triton import block_rows, num_padded_rows, tile_coords
from moe_kernels.align import SlotBlocks, align_slots, flat_ids, unsorted_slots
from moe_kernels.launch_config import (
    GemmConfig, LaunchConfig, as_grouped, device_name, get_launch_config, quantization_name, with_min_block_k,
)
from moe_kernels.mxfp4 import VALUES_PER_SCALE
from moe_kernels.quant import FP8_DTYPE

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_WEIGHT_8BIT = (FP8_DTYPE, torch.int8)
_WEIGHT_QUANTIZED = (*_WEIGHT_8BIT, torch.uint8, torch.int32)  # uint8: MXFP4, int32: INT4
_WEIGHT_4BIT = {torch.uint8: 3, torch.int32: 4}  # the QUANT constexpr of packed 4-bit weights


@triton.jit
def _rows_k_tile(ptrs, row_ok, offs_k, k_left, EVEN_K: tl.constexpr):
    # The activation tile at ptrs [BLOCK_M, BLOCK_K], rows not row_ok read as 0, and k_ok [BLOCK_K]: the columns
    # before K's end (k_left columns remain), which the weight tile's load masks by too. With EVEN_K every
    # column is inside K: only the rows are masked.
    k_ok = offs_k < k_left
    if EVEN_K:
        a = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        a = tl.load(ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    return a, k_ok


# num_slots and num_blocks_m change with every token count: specializing on their divisibility would
# compile each launch config up to four times, at whatever step first hits each variant.
# QUANT: 0 float weights, 1 8-bit with per-channel scales, 2 8-bit with QBLOCK_N x QBLOCK_K block scales,
# 3 MXFP4 (w: packed uint8 [E, N, K/2], scale: uint8 [E, N, K/32]), 4 INT4 (w: packed int32 [E, N, K/8],
# scale: bfloat16 or float32 [E, N, K/32]).
@triton.jit(do_not_specialize=["num_slots", "num_blocks_m"])
def _w13_act_kernel(
    x_ptr, w_ptr, out_ptr, scale_ptr, bias_ptr,  # x [T, H], w13 [E, 2I, H], out [S, I], scale (see QUANT), bias [E, 2I]
    sorted_slots_ptr, block_expert_ptr, num_padded_ptr,
    num_slots, top_k, inter_size, hidden_size, num_blocks_m,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_os, stride_oi,
    stride_se, stride_sn, stride_sk, stride_be, act_alpha, act_limit,
    SORTED: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, QUANT: tl.constexpr, QBLOCK_N: tl.constexpr, QBLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tile_coords(num_blocks_m, inter_size, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= num_padded_rows(num_padded_ptr, num_blocks_m, SORTED, BLOCK_M):
        return  # the grid is sized for the worst case; this block got no slots
    slots, row_ok, expert = block_rows(pid_m, sorted_slots_ptr, block_expert_ptr, num_slots, SORTED, BLOCK_M)
    tokens = slots // top_k  # [BLOCK_M]

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns of gate (and of up, I rows further)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < inter_size
    a_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xh  # [BLOCK_M, BLOCK_K]
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wh  # [BLOCK_K, BLOCK_N]
    u_ptrs = g_ptrs + inter_size * stride_wn

    # Gate and up tiles in the same program: the activation needs both, and
    # they share the x tile, so x is read once for 2*BLOCK_N output columns.
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(hidden_size, BLOCK_K)):
        a, k_ok = _rows_k_tile(a_ptrs, row_ok, offs_k, hidden_size - kk * BLOCK_K, EVEN_K)  # [BLOCK_M, BLOCK_K]
        if QUANT >= 3:  # MXFP4 or INT4: [BLOCK_N, BLOCK_K] float32 tiles, transposed to [BLOCK_K, BLOCK_N]
            g = tl.trans(packed4_tile(w_ptr, scale_ptr, expert, offs_n, n_ok, kk * BLOCK_K, hidden_size, stride_we,
                                      stride_wn, stride_se, stride_sn, BLOCK_K, EVEN_K, QUANT))
            u = tl.trans(packed4_tile(w_ptr, scale_ptr, expert, inter_size + offs_n, n_ok, kk * BLOCK_K, hidden_size,
                                      stride_we, stride_wn, stride_se, stride_sn, BLOCK_K, EVEN_K, QUANT))
        elif EVEN_K:
            g = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            # Interpreter only: it multiplies bfloat16 tiles as raw uint16. float32
            # products of bf16 values are exact, as on tensor cores.
            a = a.to(tl.float32)
        if UPCAST or QUANT != 0:
            g, u = g.to(a.dtype), u.to(a.dtype)  # 8-bit values are exact in every activation dtype
        if QUANT == 2:
            k_start = kk * BLOCK_K
            s_g = scale_cols(scale_ptr, expert, offs_n, n_ok, 0, k_start, stride_se, stride_sn, stride_sk,
                              QUANT, QBLOCK_N, QBLOCK_K)
            s_u = scale_cols(scale_ptr, expert, offs_n, n_ok, tl.cdiv(inter_size, QBLOCK_N), k_start, stride_se,
                              stride_sn, stride_sk, QUANT, QBLOCK_N, QBLOCK_K)
            acc_g += tl.dot(a, g, input_precision=PRECISION) * s_g[None, :]
            acc_u += tl.dot(a, u, input_precision=PRECISION) * s_u[None, :]
        else:
            acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_xh
        g_ptrs += BLOCK_K * stride_wh
        u_ptrs += BLOCK_K * stride_wh
    if QUANT == 1:
        acc_g *= scale_cols(scale_ptr, expert, offs_n, n_ok, 0, 0, stride_se, stride_sn, stride_sk,
                             QUANT, QBLOCK_N, QBLOCK_K)[None, :]
        acc_u *= scale_cols(scale_ptr, expert, offs_n, n_ok, inter_size, 0, stride_se, stride_sn, stride_sk,
                             QUANT, QBLOCK_N, QBLOCK_K)[None, :]
    if HAS_BIAS:  # gate bias then up bias, added in float32 before the activation
        b_row = bias_ptr + expert * stride_be
        acc_g += tl.load(b_row + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_row + inter_size + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]

    h = gated_act(acc_g, acc_u, ACTIVATION, act_alpha, act_limit).to(out_ptr.dtype.element_ty)
    out_ptrs = out_ptr + slots[:, None] * stride_os + offs_n[None, :] * stride_oi
    tl.store(out_ptrs, h, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_slots", "num_blocks_m"])
def _w2_weighted_kernel(
    h_ptr, w_ptr, topk_weights_ptr, out_ptr, scale_ptr, bias_ptr,  # h [S, I], w2 [E, H, I], topk_weights [S] f32,
    sorted_slots_ptr, block_expert_ptr, num_padded_ptr,             # out [S, H], scale, bias [E, H]
    num_slots, hidden_size, inter_size, num_blocks_m,
    stride_hs, stride_hi, stride_we, stride_wn, stride_wi, stride_os, stride_on,
    stride_se, stride_sn, stride_sk, stride_be,
    SORTED: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, QUANT: tl.constexpr, QBLOCK_N: tl.constexpr, QBLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tile_coords(num_blocks_m, hidden_size, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= num_padded_rows(num_padded_ptr, num_blocks_m, SORTED, BLOCK_M):
        return
    slots, row_ok, expert = block_rows(pid_m, sorted_slots_ptr, block_expert_ptr, num_slots, SORTED, BLOCK_M)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] hidden columns
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < hidden_size
    a_ptrs = h_ptr + slots[:, None] * stride_hs + offs_k[None, :] * stride_hi  # [BLOCK_M, BLOCK_K]
    b_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wi  # [BLOCK_K, BLOCK_N]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(inter_size, BLOCK_K)):
        a, k_ok = _rows_k_tile(a_ptrs, row_ok, offs_k, inter_size - kk * BLOCK_K, EVEN_K)  # [BLOCK_M, BLOCK_K]
        if QUANT >= 3:  # MXFP4 or INT4: a [BLOCK_N, BLOCK_K] float32 tile, transposed to [BLOCK_K, BLOCK_N]
            b = tl.trans(packed4_tile(w_ptr, scale_ptr, expert, offs_n, n_ok, kk * BLOCK_K, inter_size, stride_we,
                                      stride_wn, stride_se, stride_sn, BLOCK_K, EVEN_K, QUANT))
        elif EVEN_K:
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
        if UPCAST or QUANT != 0:
            b = b.to(a.dtype)
        if QUANT == 2:
            s_b = scale_cols(scale_ptr, expert, offs_n, n_ok, 0, kk * BLOCK_K, stride_se, stride_sn, stride_sk,
                              QUANT, QBLOCK_N, QBLOCK_K)
            acc += tl.dot(a, b, input_precision=PRECISION) * s_b[None, :]
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_hi
        b_ptrs += BLOCK_K * stride_wi
    if QUANT == 1:
        acc *= scale_cols(scale_ptr, expert, offs_n, n_ok, 0, 0, stride_se, stride_sn, stride_sk,
                           QUANT, QBLOCK_N, QBLOCK_K)[None, :]
    if HAS_BIAS:  # inside the routing weight, as the expert's own output
        acc += tl.load(bias_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]

    # Routing weight in the epilogue, in float32, before the one rounding to the output dtype.
    weight = tl.load(topk_weights_ptr + slots, mask=row_ok, other=0.0)  # [BLOCK_M]
    y = (acc * weight[:, None]).to(out_ptr.dtype.element_ty)
    out_ptrs = out_ptr + slots[:, None] * stride_os + offs_n[None, :] * stride_on
    tl.store(out_ptrs, y, mask=row_ok[:, None] & n_ok[None, :])


# Decided once, at decoration: interpreted kernels run on CPU tensors, compiled ones on CUDA.
INTERPRETED = not isinstance(_w13_act_kernel, triton.runtime.JITFunction)


def _dot_args(dtype: torch.dtype) -> dict:
    # float32 inputs get IEEE fp32 dot products (no tf32) so the backend matches
    # the torch reference to ~1e-6; for 16-bit inputs the precision flag has no
    # effect and "tf32" is simply Triton's default.
    return {
        "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "UPCAST": INTERPRETED and dtype == torch.bfloat16,
    }


def _quant_args(w: torch.Tensor, scale: torch.Tensor | None, block_shape: tuple[int, int] | None) -> tuple:
    """(scale pointer, its three strides), then the QUANT constexprs, for weight ``w`` [E, N, K]."""
    if scale is None:
        return (w, 0, 0, 0), {"QUANT": 0, "QBLOCK_N": 1, "QBLOCK_K": 1}  # the pointer is never read
    if w.dtype in _WEIGHT_4BIT:  # MXFP4 / INT4: the tile readers step along K by elements and scales, contiguous
        assert w.stride(2) == 1 and scale.stride(2) == 1, "4-bit weights and scales must be contiguous along K"
        return (scale, scale.stride(0), scale.stride(1), 1), {"QUANT": _WEIGHT_4BIT[w.dtype], "QBLOCK_N": 1,
                                                              "QBLOCK_K": 1}
    if block_shape is None:
        return (scale, scale.stride(0), scale.stride(1), 0), {"QUANT": 1, "QBLOCK_N": 1, "QBLOCK_K": 1}
    return ((scale, *scale.stride()),
            {"QUANT": 2, "QBLOCK_N": block_shape[0], "QBLOCK_K": block_shape[1]})


def _fit_scale_blocks(cfg: GemmConfig, block_shape: tuple[int, int] | None) -> GemmConfig:
    """``cfg`` with BLOCK_K halved until it divides the scale block's K (one scale per K step)."""
    if block_shape is None or block_shape[1] % cfg.BLOCK_K == 0:
        return cfg
    block_k = cfg.BLOCK_K
    while block_shape[1] % block_k:
        block_k //= 2
    return dataclasses.replace(cfg, BLOCK_K=block_k)


def _check_block_k(w: torch.Tensor, cfg: GemmConfig) -> None:
    """4-bit tiles hold whole scale groups: BLOCK_K a multiple of 32 (``mxfp4_tile``, ``int4_tile``)."""
    if w.dtype in _WEIGHT_4BIT and cfg.BLOCK_K % VALUES_PER_SCALE:
        raise ValueError(f"MXFP4 and INT4 weights need launch configs with BLOCK_K a multiple of {VALUES_PER_SCALE} "
                         f"(one scale per {VALUES_PER_SCALE} values along K), got BLOCK_K={cfg.BLOCK_K}")


def _gemv_weight(w: torch.Tensor, cfg: GemmConfig) -> tuple[torch.Tensor, dict]:
    """The weight the matrix-vector kernels read and the PLANES constexpr: 4-bit weights with ``cfg.PLANES`` as int32
    words [E, N, K/8] (MXFP4's bytes viewed so, INT4's as they are: ``planes_triton``), anything else as given."""
    if not (cfg.PLANES and w.dtype in _WEIGHT_4BIT):
        return w, {"PLANES": False}
    return (w.view(torch.int32) if w.dtype == torch.uint8 else w), {"PLANES": True}


def _bias_args(w: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """(bias pointer, its expert stride) and the HAS_BIAS constexpr; bias [E, N] contiguous along N."""
    if bias is None:
        return (w, 0), {"HAS_BIAS": False}  # the pointer is never read
    assert bias.stride(-1) == 1, "expert biases must be contiguous along their last dim"
    return (bias, bias.stride(0)), {"HAS_BIAS": True}


def _act_args(activation: ExpertActivation) -> tuple:
    return (activation.alpha, activation.limit), {"ACTIVATION": activation.kind}


_SPLIT_SUM_BLOCK = 1024  # columns per program of the split-K sums (elementwise over [S, N])


def _swapped(w: torch.Tensor, cfg: GemmConfig) -> bool:
    """Whether a grouped GEMM over ``w`` takes the swapped-operand kernels: MXFP4 weights with ``cfg.SWAP``."""
    return cfg.SWAP and w.dtype == torch.uint8


def _splits(k_size: int, cfg: GemmConfig) -> tuple[int, int]:
    """(programs along K, BLOCK_K steps each) for ``cfg.SPLIT_K``: at most SPLIT_K, none of them empty."""
    steps = triton.cdiv(k_size, cfg.BLOCK_K)
    per_split = triton.cdiv(steps, min(cfg.SPLIT_K, steps))
    return triton.cdiv(steps, per_split), per_split


def _grid(blocks: SlotBlocks, n_size: int, cfg: GemmConfig) -> tuple[int]:
    return (blocks.num_blocks * triton.cdiv(n_size, cfg.BLOCK_N),)


def invoke_w13(x: torch.Tensor, w13: torch.Tensor, out: torch.Tensor, blocks: SlotBlocks, top_k: int,
               cfg: GemmConfig, activation: ExpertActivation = SILU, scale: torch.Tensor | None = None,
               block_shape: tuple[int, int] | None = None, bias: torch.Tensor | None = None) -> None:
    """Kernel 1: out[s] = act(x[s // k] @ gate[e]^T + b_gate[e], x[s // k] @ up[e]^T + b_up[e]) for every slot s.

    x [T, H], w13 [E, 2I, H], out [S, I] (written, every row); ``scale`` with 8-bit or MXFP4 w13 (``fused_moe``'s
    layouts); ``bias`` [E, 2I] or None.
    """
    inter, hidden = w13.shape[1] // 2, x.shape[1]  # not w13.shape[2]: MXFP4 packs two values a byte
    cfg = _fit_scale_blocks(cfg, block_shape)
    _check_block_k(w13, cfg)
    (scale_ptr, *scale_strides), quant = _quant_args(w13, scale, block_shape)
    (bias_ptr, bias_stride), has_bias = _bias_args(w13, bias)
    act_values, act_kind = _act_args(activation)
    if _swapped(w13, cfg):
        splits, per_split = _splits(hidden, cfg)
        # Float32 partial sums [splits, S, 2I] (gate, then up) where K is split, else the output itself.
        target = out if splits == 1 else torch.empty(splits, out.shape[0], 2 * inter, dtype=torch.float32,
                                                     device=out.device)
        swapped_triton.w13_swapped_kernel[(*_grid(blocks, inter, cfg), splits)](
            x, w13, target, scale_ptr, bias_ptr,
            blocks.sorted_slot_ids, blocks.block_expert_ids, blocks.num_padded,
            out.shape[0], top_k, inter, hidden, blocks.num_blocks, per_split,
            x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), target.stride(-2), target.stride(-1),
            target.stride(0) if splits > 1 else 0, *scale_strides[:2], bias_stride, *act_values, **has_bias,
            **act_kind, SORTED=blocks.sorted, EVEN_K=hidden % cfg.BLOCK_K == 0, BLOCK_M=blocks.block_m,
            BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M, SPLIT=splits > 1,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_dot_args(x.dtype),
        )
        if splits > 1:
            swapped_triton.w13_split_sum_kernel[(out.shape[0], triton.cdiv(inter, _SPLIT_SUM_BLOCK))](
                target, out, splits, inter, target.stride(0), target.stride(1), out.stride(0), *act_values,
                **act_kind, BLOCK_N=_SPLIT_SUM_BLOCK,
            )
        return
    _w13_act_kernel[_grid(blocks, inter, cfg)](
        x, w13, out, scale_ptr, bias_ptr,
        blocks.sorted_slot_ids, blocks.block_expert_ids, blocks.num_padded,
        out.shape[0], top_k, inter, hidden, blocks.num_blocks,
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), out.stride(0), out.stride(1),
        *scale_strides, bias_stride, *act_values, **quant, **has_bias, **act_kind,
        SORTED=blocks.sorted, EVEN_K=hidden % cfg.BLOCK_K == 0,
        BLOCK_M=blocks.block_m, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_dot_args(x.dtype),
    )


def invoke_w2(h: torch.Tensor, w2: torch.Tensor, slot_weights: torch.Tensor, out: torch.Tensor,
              blocks: SlotBlocks, cfg: GemmConfig, scale: torch.Tensor | None = None,
              block_shape: tuple[int, int] | None = None, bias: torch.Tensor | None = None) -> None:
    """Kernel 2: out[s] = slot_weights[s] * (h[s] @ w2[e]^T + bias[e]) for every slot s.

    h [S, I], w2 [E, H, I], slot_weights [S] float32 contiguous, out [S, H] (written, every row);
    ``scale`` with 8-bit or MXFP4 w2; ``bias`` [E, H] or None.
    """
    hidden, inter = w2.shape[1], h.shape[1]  # not w2.shape[2]: MXFP4 packs two values a byte
    cfg = _fit_scale_blocks(cfg, block_shape)
    _check_block_k(w2, cfg)
    (scale_ptr, *scale_strides), quant = _quant_args(w2, scale, block_shape)
    (bias_ptr, bias_stride), has_bias = _bias_args(w2, bias)
    if _swapped(w2, cfg):
        splits, per_split = _splits(inter, cfg)
        # Float32 partial sums [splits, S, H], unweighted, where K is split, else the output itself.
        target = out if splits == 1 else torch.empty(splits, *out.shape, dtype=torch.float32, device=out.device)
        swapped_triton.w2_swapped_kernel[(*_grid(blocks, hidden, cfg), splits)](
            h, w2, slot_weights, target, scale_ptr, bias_ptr,
            blocks.sorted_slot_ids, blocks.block_expert_ids, blocks.num_padded,
            out.shape[0], hidden, inter, blocks.num_blocks, per_split,
            h.stride(0), h.stride(1), w2.stride(0), w2.stride(1), target.stride(-2), target.stride(-1),
            target.stride(0) if splits > 1 else 0, *scale_strides[:2], bias_stride, **has_bias,
            SORTED=blocks.sorted, EVEN_K=inter % cfg.BLOCK_K == 0, BLOCK_M=blocks.block_m, BLOCK_N=cfg.BLOCK_N,
            BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M, SPLIT=splits > 1,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_dot_args(h.dtype),
        )
        if splits > 1:
            swapped_triton.w2_split_sum_kernel[(out.shape[0], triton.cdiv(hidden, _SPLIT_SUM_BLOCK))](
                target, slot_weights, out, splits, hidden, target.stride(0), target.stride(1), out.stride(0),
                BLOCK_N=_SPLIT_SUM_BLOCK,
            )
        return
    _w2_weighted_kernel[_grid(blocks, hidden, cfg)](
        h, w2, slot_weights, out, scale_ptr, bias_ptr,
        blocks.sorted_slot_ids, blocks.block_expert_ids, blocks.num_padded,
        out.shape[0], hidden, inter, blocks.num_blocks,
        h.stride(0), h.stride(1), w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0), out.stride(1),
        *scale_strides, bias_stride, **quant, **has_bias,
        SORTED=blocks.sorted, EVEN_K=inter % cfg.BLOCK_K == 0,
        BLOCK_M=blocks.block_m, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_dot_args(h.dtype),
    )


def invoke_w13_gemv(x: torch.Tensor, w13: torch.Tensor, ids: torch.Tensor, inter: torch.Tensor, top_k: int,
                    cfg: GemmConfig, activation: ExpertActivation = SILU, scale: torch.Tensor | None = None,
                    block_shape: tuple[int, int] | None = None, bias: torch.Tensor | None = None) -> None:
    """Matrix-vector kernel 1: inter[s] = act(gate[e] @ x[s // k] + b_gate[e], up[e] @ x[s // k] + b_up[e]);
    ids [S] int32.

    w13 [E, 2I, H] contiguous along H; every row of inter [S, I] is written; ``scale`` with 8-bit or MXFP4 w13.
    """
    inter_size, hidden = w13.shape[1] // 2, x.shape[1]  # not w13.shape[2]: MXFP4 packs two values a byte
    cfg = _fit_scale_blocks(cfg, block_shape)
    _check_block_k(w13, cfg)
    (scale_ptr, *scale_strides), quant = _quant_args(w13, scale, block_shape)
    (bias_ptr, bias_stride), has_bias = _bias_args(w13, bias)
    act_values, act_kind = _act_args(activation)
    w13, planes = _gemv_weight(w13, cfg)
    gemv_kernels.w13_gemv_kernel[(ids.numel(), triton.cdiv(inter_size, cfg.BLOCK_N))](
        x, w13, ids, inter, scale_ptr, bias_ptr, top_k, inter_size, hidden, x.stride(0), w13.stride(0),
        w13.stride(1), inter.stride(0), *scale_strides, bias_stride, *act_values, **quant, **has_bias, **act_kind,
        **planes,
        BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, EVEN_K=hidden % cfg.BLOCK_K == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def invoke_w2_gemv(inter: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, slot_weights: torch.Tensor,
                   out: torch.Tensor, top_k: int, cfg: GemmConfig, scale: torch.Tensor | None = None,
                   block_shape: tuple[int, int] | None = None, bias: torch.Tensor | None = None) -> None:
    """Matrix-vector kernel 2: out[t] = sum_j slot_weights[t*k+j] * (w2[e_j] @ inter[t*k+j] + bias[e_j]).

    w2 [E, H, I] contiguous along I; ids [S] int32; every row of out [T, H] is written; ``scale`` with 8-bit or MXFP4 w2.
    """
    hidden, inter_size = w2.shape[1], inter.shape[1]  # not w2.shape[2]: MXFP4 packs two values a byte
    cfg = _fit_scale_blocks(cfg, block_shape)
    _check_block_k(w2, cfg)
    (scale_ptr, *scale_strides), quant = _quant_args(w2, scale, block_shape)
    (bias_ptr, bias_stride), has_bias = _bias_args(w2, bias)
    w2, planes = _gemv_weight(w2, cfg)
    gemv_kernels.w2_gemv_sum_kernel[(out.shape[0], triton.cdiv(hidden, cfg.BLOCK_N))](
        inter, w2, ids, slot_weights, out, scale_ptr, bias_ptr, top_k, hidden, inter_size,
        inter.stride(0), w2.stride(0), w2.stride(1), out.stride(0), *scale_strides, bias_stride, **quant, **has_bias,
        **planes,
        BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, EVEN_K=inter_size % cfg.BLOCK_K == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def slot_blocks(topk_ids: torch.Tensor, num_experts: int, cfg: LaunchConfig) -> SlotBlocks:
    """The row blocks both kernels iterate over, sorted by expert or not as ``cfg`` says."""
    if cfg.align:
        return align_slots(topk_ids, num_experts, cfg.BLOCK_M)
    return unsorted_slots(topk_ids, cfg.BLOCK_M)


@functools.lru_cache(maxsize=1024)
def _cached_config(num_experts: int, n: int, k: int, dtype: torch.dtype, device: str, num_tokens: int,
                   quantization: str | None = None) -> LaunchConfig:
    config = get_launch_config(num_experts, n, k, dtype, device, num_tokens, quantization)
    # 4-bit tiles hold whole scale groups along K (the shipped and tuned configs have BLOCK_K >= 32 already; a
    # dtype's file it falls back to may not). INT4's groups are 32 values too (``moe_kernels.int4.GROUP_SIZE``).
    return with_min_block_k(config, VALUES_PER_SCALE) if quantization in ("mxfp4", "int4") else config


@functools.lru_cache(maxsize=16)
def _device_name(device: torch.device) -> str:
    return device_name(device)


def default_config(x: torch.Tensor, w13: torch.Tensor) -> LaunchConfig:
    """The launch config ``fused_moe_triton`` looks up when given none, for activations x [T, H] and w13 [E, 2I, ..]
    (its dtype selects the quantization's files)."""
    num_experts, two_inter, _ = w13.shape
    return _cached_config(num_experts, two_inter, x.shape[1], x.dtype, _device_name(x.device), x.shape[0],
                          quantization_name(w13.dtype))


def _check_inputs(x, w13, w2, block_shape) -> None:
    if x.dtype not in _DTYPES:
        raise ValueError(f"triton backend supports {_DTYPES}, got {x.dtype}")
    if w13.dtype != w2.dtype or (w13.dtype != x.dtype and w13.dtype not in _WEIGHT_QUANTIZED):
        raise ValueError(f"w13 and w2 must share x's dtype or be 8-bit, MXFP4 or INT4 ({_WEIGHT_QUANTIZED}), got {x.dtype}, "
                         f"{w13.dtype}, {w2.dtype}")
    if block_shape is not None and (block_shape[1] % 16 or min(block_shape) < 16):
        raise ValueError(f"triton backend needs scale blocks of at least 16 with block_k a multiple of 16, "
                         f"got {block_shape}")
    if x.is_cuda == INTERPRETED:
        raise RuntimeError(
            "the triton backend needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set before "
            f"moe_kernels.triton_backend is first imported (x is on {x.device}, interpreter {'on' if INTERPRETED else 'off'})"
        )


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: "str | ExpertActivation" = "silu",
    *,
    config: LaunchConfig | None = None,
    inter: torch.Tensor | None = None,
    slot_out: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts with the Triton kernels; same contract as ``moe_kernels.fused_moe``.

    Args:
        x: [T, H] float32, bfloat16 or float16; w13 [E, 2I, H] and w2 [E, H, I] in the same dtype.
        topk_weights: [T, k] routing weights (float32 from ``route``).
        topk_ids: [T, k] int32 expert ids.
        activation: an ``ExpertActivation`` (or its kind name) applied to the gate and up halves.
        config: launch parameters; default: looked up by shape, dtype, device and T.
        inter, slot_out, out: optional preallocated [T*k, I], [T*k, H] and [T, H]
            buffers in x's dtype (tests poison them to catch unwritten elements).
        w13_scale, w2_scale, block_shape: with 8-bit w13 and w2, their scales (layouts as ``moe_kernels.fused_moe``).
        w13_bias, w2_bias: optional per-expert biases [E, 2I] (gate then up) and [E, H].

    Returns:
        [T, H] in x's dtype: sum over k of topk_weight * expert(x).
    """
    _check_inputs(x, w13, w2, block_shape)
    activation = ExpertActivation.of(activation)
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return torch.empty_like(x) if out is None else out
    num_experts, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    num_slots = num_tokens * top_k
    if config is None:
        config = default_config(x, w13)

    if inter is None:
        inter = torch.empty(num_slots, two_inter // 2, dtype=x.dtype, device=x.device)  # [S, I]
    slot_weights = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [S], a no-op for route()'s output
    if config.gemv and w13.stride(2) == 1 and w2.stride(2) == 1 and x.stride(1) == 1:
        if out is None:
            out = torch.empty_like(x)  # [T, H]
        ids = flat_ids(topk_ids)
        invoke_w13_gemv(x, w13, ids, inter, top_k, config.w13, activation, w13_scale, block_shape, w13_bias)
        invoke_w2_gemv(inter, w2, ids, slot_weights, out, top_k, config.w2, w2_scale, block_shape, w2_bias)
        return out

    config = as_grouped(config)  # a gemv config whose weights the matrix-vector kernels cannot read
    blocks = slot_blocks(topk_ids, num_experts, config)
    if slot_out is None:
        slot_out = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)  # [S, H]

    invoke_w13(x, w13, inter, blocks, top_k, config.w13, activation, w13_scale, block_shape, w13_bias)
    invoke_w2(inter, w2, slot_weights, slot_out, blocks, config.w2, w2_scale, block_shape, w2_bias)

    # Sum over k in torch rather than with atomics in kernel 2: the result is
    # deterministic (fixed summation order, run to run and batch to batch),
    # torch accumulates half types in float32 and rounds once, and no zero-
    # filled output is needed. The price is one [S, H] write + read.
    per_token = slot_out.view(num_tokens, top_k, hidden)  # [T, k, H]
    if out is None:
        return per_token[:, 0] if top_k == 1 else per_token.sum(dim=1)  # [T, H]
    return torch.sum(per_token, dim=1, out=out)
