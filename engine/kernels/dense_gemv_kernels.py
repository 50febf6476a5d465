"""Triton matrix-vector kernels for the dense projections at decode sizes (a handful of rows).

Legend: M rows (tokens, 1..8), N output features, K input features, S K-splits.

    y[M, N] = x[M, K] @ W[N, K]^T (+ b[N])

At M <= 8 a projection is a read of W and nothing else: the work is to keep
enough bytes of W in flight. Each program owns BLOCK_N rows of W and one
K-range (split S of the grid's second axis) and streams [BLOCK_N, BLOCK_K]
tiles of W through it, once for all M rows:

- FMA path (USE_DOT False): float32 partial products per lane in a
  [BLOCK_M, BLOCK_N, BLOCK_K] accumulator, summed over K once at the end (no
  cross-lane reduction inside the loop);
- dot path (USE_DOT True): the rows padded to BLOCK_M >= 16 and ``tl.dot`` on
  the tensor cores, whose operand loads Triton pipelines through shared memory.

With one split the program adds the bias and writes y in x's dtype. With
S > 1 it writes float32 partial sums to part[S, M, N] and ``split_k_sum_kernel``
adds the splits in a fixed order (the same result every run), adds the bias
and rounds once. Tall-skinny shapes (o_proj 4096 -> 2048, the router
2048 -> 128) have too few row blocks to occupy every SM; splitting K gives
them more programs.

Set ``TRITON_INTERPRET=1`` before this module is first imported to run them
on the CPU (tests).
"""

import triton
import triton.language as tl


# The row count and the split arithmetic change with the batch, or between shapes sharing a kernel: specializing
# on their values (1, divisibility by 16) would compile one variant per value, at whatever step first meets it.
@triton.jit(do_not_specialize=["num_rows", "split_k", "split_tiles"])
def dense_gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, part_ptr,  # x [M, K], w [N, K], b [N], out [M, N]; part [S, M, N] f32
    num_rows, n_size, k_size, split_k, split_tiles,  # split_tiles: BLOCK_K tiles of K per split
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < num_rows
    n_ok = offs_n < n_size
    # A split starts at a multiple of the constexpr BLOCK_K, so the compiler knows each row's K offsets
    # stay 16-byte aligned and vectorizes the loads (a split width in columns, a runtime int, would not tell it).
    k_start = pid_k * split_tiles * BLOCK_K
    k_len = tl.minimum(split_tiles * BLOCK_K, k_size - k_start)  # this split's columns (the last may have fewer)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_start + offs_k)[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]  # [BLOCK_N, BLOCK_K]
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for kk in range(0, tl.cdiv(k_len, BLOCK_K)):
        if EVEN_K:  # K is a multiple of BLOCK_K: no tile crosses the end of K
            xv = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            wv = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = offs_k < k_len - kk * BLOCK_K
            xv = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            wv = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if USE_DOT:
            if UPCAST:  # interpreter only: it multiplies bfloat16 tiles as raw integers
                xv, wv = xv.to(tl.float32), wv.to(tl.float32)
            acc = tl.dot(xv, tl.trans(wv), acc, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        else:
            acc3 += xv.to(tl.float32)[:, None, :] * wv.to(tl.float32)[None, :, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if not USE_DOT:
        acc = tl.sum(acc3, axis=2)  # [BLOCK_M, BLOCK_N]
    ok = m_ok[:, None] & n_ok[None, :]
    if split_k == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        part_rows = (pid_k * num_rows + offs_m[:, None]).to(tl.int64)
        tl.store(part_ptr + part_rows * n_size + offs_n[None, :], acc, mask=ok)


@triton.jit(do_not_specialize=["num_rows", "split_k"])
def split_k_sum_kernel(
    part_ptr, b_ptr, out_ptr,  # part [S, M, N] f32, b [N], out [M, N]
    num_rows, n_size, split_k, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Program (row, column block): the splits summed in order 0..S-1, in float32, then one rounding.
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_size
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in range(0, split_k):
        total += tl.load(part_ptr + (s * num_rows + row) * n_size + offs_n, mask=n_ok, other=0.0)
    if HAS_BIAS:
        total += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)
