"""Triton kernel for the routed experts' LoRA deltas: every (expert, adapter) group of a step in one launch.

Legend: G groups (expert, adapter), R rank (padded), K input features, N output features, M rows per block.

    out[p] += B[g] @ (A[g] @ x[p])   for each pair p of group g

The pairs arrive sorted by group (``adapted``: their rows of x and out, group g's run ending at ``ends[g]``).
Program (g, j) owns rows j*BLOCK_M.. of group g's run (none left: it returns at once); it gathers those rows of
x, computes their [BLOCK_M, R] low-rank product through K in float32 (the shrink), then walks N in BLOCK_N tiles
multiplying it by B's tiles and adding into out (the expand). A pair belongs to one group and one program, so
out's rows are written by one program each: no atomics, the same result every run.

Set ``TRITON_INTERPRET=1`` before this module is first imported to run it on the CPU (tests).
"""

import triton
import triton.language as tl


# The group sizes change every step: specializing on them would compile one variant per value.
@triton.jit(do_not_specialize=["in_size", "out_size", "rank"])
def expert_lora_delta_kernel(
    x_ptr, adapted_ptr, ends_ptr, a_ptr, b_ptr, out_ptr,  # x [P, K], adapted [P_a], ends [G], a [G, R, K], b [G, N, R], out [P, N]
    in_size, out_size, rank,
    stride_xm, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    g = tl.program_id(0)
    start = tl.load(ends_ptr + g - 1, mask=g > 0, other=0)
    end = tl.load(ends_ptr + g)
    first = start + tl.program_id(1) * BLOCK_M
    if first >= end:
        return
    offs_m = first + tl.arange(0, BLOCK_M)
    row_mask = offs_m < end
    rows = tl.load(adapted_ptr + offs_m, mask=row_mask, other=0).to(tl.int64)  # [BLOCK_M] rows of x and out
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    a_base = a_ptr + g.to(tl.int64) * rank * in_size
    low = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, in_size, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < in_size
        xt = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                     mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        at = tl.load(a_base + offs_r[None, :] * in_size + offs_k[:, None],
                     mask=k_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_R]
        if UPCAST:  # interpreter only: it multiplies bfloat16 tiles as raw integers
            xt, at = xt.to(tl.float32), at.to(tl.float32)
        low = tl.dot(xt, at, low, input_precision=PRECISION)
    # The expand multiplies in the factors' dtype (tensor cores for 16-bit), accumulating in float32.
    low_in = low.to(tl.float32) if UPCAST else low.to(b_ptr.dtype.element_ty)
    b_base = b_ptr + g.to(tl.int64) * out_size * rank
    for n0 in range(0, out_size, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < out_size
        bt = tl.load(b_base + offs_n[None, :] * rank + offs_r[:, None],
                     mask=r_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
        if UPCAST:
            bt = bt.to(tl.float32)
        delta = tl.dot(low_in, bt, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N] float32
        mask = row_mask[:, None] & n_mask[None, :]
        o_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
        current = tl.load(o_ptrs, mask=mask, other=0.0)
        tl.store(o_ptrs, (current.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=mask)
