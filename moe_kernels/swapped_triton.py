"""Swapped-operand grouped GEMMs for MXFP4 experts (``GemmConfig.SWAP``), with split-K (``GemmConfig.SPLIT_K``).

Legend as ``triton_backend``: T tokens, H hidden, I expert intermediate, E experts, k top-k, S = T*k slots.

The tile kernels multiply a block's activations [BLOCK_M, BLOCK_K] by a decoded weight tile transposed
[BLOCK_K, BLOCK_N]: the block's slots are the MMA's M, which on sm_90 is a 64-row wgmma per warp group, so a block
of a few slots pads most of it, and the decoded tile goes through shared memory as the B operand. Here the operands
are swapped: each program decodes W[expert, rows, k : k + BLOCK_K] as [BLOCK_N, BLOCK_K] (``mxfp4_tile``) and takes
it as the first operand against the block's activations transposed [BLOCK_K, BLOCK_M]:

    acc [BLOCK_N, BLOCK_M] = W_tile @ X_block^T

so the weight rows are M (wgmma's A operand may come straight from registers) and the slots are N, 16 at least.
The epilogue (bias, activation or routing weight) is the tile kernels', on the transposed accumulator.

Split-K (``SPLIT`` with the host's split count > 1): program (block, column tile, split j) sums the K steps
[j * steps_per_split, (j + 1) * steps_per_split) and stores its float32 partial sums, bias included in split 0, to
partials[j, slot, column]; ``w13_split_sum_kernel`` / ``w2_split_sum_kernel`` then add partials[0], [1], ... in
that order and apply the activation or the routing weight: no atomics, the same sums on every run.
"""

import triton
import triton.language as tl

from moe_kernels.activation_triton import gated_act
from moe_kernels.blocks_triton import block_rows, num_padded_rows, tile_coords
from moe_kernels.mxfp4_triton import mxfp4_tile


@triton.jit
def _split_steps(k_size, steps_per_split, BLOCK_K: tl.constexpr):
    # -> (the K offset of this program's first step, its number of steps): split tl.program_id(1).
    k_first = tl.program_id(1) * steps_per_split * BLOCK_K
    return k_first, tl.minimum(steps_per_split, tl.cdiv(k_size - k_first, BLOCK_K))


@triton.jit
def _rows_t_tile(ptrs, row_ok, k_left, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    # The activation tile transposed at ptrs [BLOCK_K, BLOCK_M]: columns not row_ok, and K rows past K's end
    # (k_left remain; never with EVEN_K), read as 0.
    if EVEN_K:
        xt = tl.load(ptrs, mask=row_ok[None, :], other=0.0)
    else:
        xt = tl.load(ptrs, mask=row_ok[None, :] & (tl.arange(0, BLOCK_K) < k_left)[:, None], other=0.0)
    return xt


@triton.jit
def _swapped_dot(acc, w_tile, xt, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # acc [BLOCK_N, BLOCK_M] + w_tile [BLOCK_N, BLOCK_K] float32 @ xt [BLOCK_K, BLOCK_M], the weights in xt's dtype
    # (exact: an MXFP4 value is a 2-bit significand times a power of two). UPCAST (interpreter only: it multiplies
    # bfloat16 tiles as raw uint16) multiplies in float32, exact products as on tensor cores.
    if UPCAST:
        xt = xt.to(tl.float32)
    return tl.dot(w_tile.to(xt.dtype), xt, acc, input_precision=PRECISION)


# num_slots and num_blocks_m change with every token count: not specialized (see triton_backend).
@triton.jit(do_not_specialize=["num_slots", "num_blocks_m"])
def w13_swapped_kernel(
    x_ptr, w_ptr, out_ptr, scale_ptr, bias_ptr,  # x [T, H], w13 packed [E, 2I, H/2], out (below), scale [E, 2I, H/32]
    sorted_slots_ptr, block_expert_ptr, num_padded_ptr,
    num_slots, top_k, inter_size, hidden_size, num_blocks_m, steps_per_split,
    stride_xt, stride_xh, stride_we, stride_wn, stride_os, stride_on, stride_oj, stride_se, stride_sn, stride_be,
    act_alpha, act_limit,
    SORTED: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT: tl.constexpr,
):
    # out: without SPLIT inter [S, I] (act(gate) * up); with SPLIT float32 partials [splits, S, 2I] (gate, then up;
    # stride_oj between splits).
    pid_m, pid_n = tile_coords(num_blocks_m, inter_size, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= num_padded_rows(num_padded_ptr, num_blocks_m, SORTED, BLOCK_M):
        return  # the grid is sized for the worst case; this block got no slots
    slots, row_ok, expert = block_rows(pid_m, sorted_slots_ptr, block_expert_ptr, num_slots, SORTED, BLOCK_M)
    tokens = slots // top_k  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] gate rows (and up rows, I further)
    n_ok = offs_n < inter_size
    k_first, steps = _split_steps(hidden_size, steps_per_split, BLOCK_K)
    xt_ptrs = (x_ptr + tokens[None, :] * stride_xt
               + (k_first + tl.arange(0, BLOCK_K))[:, None] * stride_xh)  # [BLOCK_K, BLOCK_M]

    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kk in range(0, steps):
        k_start = k_first + kk * BLOCK_K
        xt = _rows_t_tile(xt_ptrs, row_ok, hidden_size - k_start, BLOCK_K, EVEN_K)  # [BLOCK_K, BLOCK_M]
        g = mxfp4_tile(w_ptr, scale_ptr, expert, offs_n, n_ok, k_start, hidden_size, stride_we, stride_wn,
                       stride_se, stride_sn, BLOCK_K, EVEN_K)  # [BLOCK_N, BLOCK_K]
        u = mxfp4_tile(w_ptr, scale_ptr, expert, inter_size + offs_n, n_ok, k_start, hidden_size, stride_we,
                       stride_wn, stride_se, stride_sn, BLOCK_K, EVEN_K)
        acc_g = _swapped_dot(acc_g, g, xt, PRECISION, UPCAST)
        acc_u = _swapped_dot(acc_u, u, xt, PRECISION, UPCAST)
        xt_ptrs += BLOCK_K * stride_xh
    if HAS_BIAS:  # gate bias then up bias, in float32, once: split 0's partial (the others add 0)
        b_row = bias_ptr + expert * stride_be
        b_ok = n_ok & (offs_n * 0 == tl.program_id(1))  # [BLOCK_N]
        acc_g += tl.load(b_row + offs_n, mask=b_ok, other=0.0).to(tl.float32)[:, None]
        acc_u += tl.load(b_row + inter_size + offs_n, mask=b_ok, other=0.0).to(tl.float32)[:, None]
    mask = n_ok[:, None] & row_ok[None, :]  # [BLOCK_N, BLOCK_M]
    rows_ptrs = out_ptr + tl.program_id(1) * stride_oj + slots[None, :] * stride_os  # [1, BLOCK_M]
    if SPLIT:
        tl.store(rows_ptrs + offs_n[:, None] * stride_on, acc_g, mask=mask)
        tl.store(rows_ptrs + (inter_size + offs_n)[:, None] * stride_on, acc_u, mask=mask)
    else:
        h = gated_act(acc_g, acc_u, ACTIVATION, act_alpha, act_limit).to(out_ptr.dtype.element_ty)
        tl.store(rows_ptrs + offs_n[:, None] * stride_on, h, mask=mask)


@triton.jit(do_not_specialize=["num_slots", "num_blocks_m"])
def w2_swapped_kernel(
    h_ptr, w_ptr, topk_weights_ptr, out_ptr, scale_ptr, bias_ptr,  # h [S, I], w2 packed [E, H, I/2], weights [S] f32
    sorted_slots_ptr, block_expert_ptr, num_padded_ptr,             # out (below), scale [E, H, I/32], bias [E, H]
    num_slots, hidden_size, inter_size, num_blocks_m, steps_per_split,
    stride_hs, stride_hi, stride_we, stride_wn, stride_os, stride_on, stride_oj, stride_se, stride_sn, stride_be,
    SORTED: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT: tl.constexpr,
):
    # out: without SPLIT slot_out [S, H] (times the slot's routing weight); with SPLIT float32 partials
    # [splits, S, H] (stride_oj between splits), unweighted.
    pid_m, pid_n = tile_coords(num_blocks_m, hidden_size, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= num_padded_rows(num_padded_ptr, num_blocks_m, SORTED, BLOCK_M):
        return
    slots, row_ok, expert = block_rows(pid_m, sorted_slots_ptr, block_expert_ptr, num_slots, SORTED, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] hidden rows of w2
    n_ok = offs_n < hidden_size
    k_first, steps = _split_steps(inter_size, steps_per_split, BLOCK_K)
    ht_ptrs = (h_ptr + slots[None, :] * stride_hs
               + (k_first + tl.arange(0, BLOCK_K))[:, None] * stride_hi)  # [BLOCK_K, BLOCK_M]

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kk in range(0, steps):
        k_start = k_first + kk * BLOCK_K
        ht = _rows_t_tile(ht_ptrs, row_ok, inter_size - k_start, BLOCK_K, EVEN_K)  # [BLOCK_K, BLOCK_M]
        w = mxfp4_tile(w_ptr, scale_ptr, expert, offs_n, n_ok, k_start, inter_size, stride_we, stride_wn, stride_se,
                       stride_sn, BLOCK_K, EVEN_K)  # [BLOCK_N, BLOCK_K]
        acc = _swapped_dot(acc, w, ht, PRECISION, UPCAST)
        ht_ptrs += BLOCK_K * stride_hi
    if HAS_BIAS:  # inside the routing weight, as the expert's own output; split 0's partial (the others add 0)
        b_ok = n_ok & (offs_n * 0 == tl.program_id(1))  # [BLOCK_N]
        acc += tl.load(bias_ptr + expert * stride_be + offs_n, mask=b_ok, other=0.0).to(tl.float32)[:, None]
    mask = n_ok[:, None] & row_ok[None, :]  # [BLOCK_N, BLOCK_M]
    ptrs = out_ptr + tl.program_id(1) * stride_oj + slots[None, :] * stride_os + offs_n[:, None] * stride_on
    if SPLIT:
        tl.store(ptrs, acc, mask=mask)
    else:
        weight = tl.load(topk_weights_ptr + slots, mask=row_ok, other=0.0)  # [BLOCK_M]
        tl.store(ptrs, (acc * weight[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def w13_split_sum_kernel(part_ptr, out_ptr, num_splits, inter_size, stride_pj, stride_ps, stride_os, act_alpha,
                         act_limit, ACTIVATION: tl.constexpr, BLOCK_N: tl.constexpr):
    # out[s, n] = act(sum_j part[j, s, n], sum_j part[j, s, I + n]), j in order; one slot and BLOCK_N columns per
    # program. part: float32 [splits, S, 2I] (gate, then up; the bias is in split 0), out [S, I].
    slot = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter_size
    g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in range(0, num_splits):
        row = part_ptr + j * stride_pj + slot * stride_ps
        g += tl.load(row + offs_n, mask=n_ok, other=0.0)
        u += tl.load(row + inter_size + offs_n, mask=n_ok, other=0.0)
    h = gated_act(g, u, ACTIVATION, act_alpha, act_limit).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + slot * stride_os + offs_n, h, mask=n_ok)


@triton.jit
def w2_split_sum_kernel(part_ptr, topk_weights_ptr, out_ptr, num_splits, hidden_size, stride_pj, stride_ps,
                        stride_os, BLOCK_N: tl.constexpr):
    # out[s, n] = topk_weights[s] * sum_j part[j, s, n], j in order. part: float32 [splits, S, H], out [S, H].
    slot = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden_size
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in range(0, num_splits):
        acc += tl.load(part_ptr + j * stride_pj + slot * stride_ps + offs_n, mask=n_ok, other=0.0)
    y = (acc * tl.load(topk_weights_ptr + slot)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + slot * stride_os + offs_n, y, mask=n_ok)
