"""The nibble-plane decode of 4-bit weights (``moe_kernels.planes_triton``, the matrix-vector kernels' ``PLANES``):
each plane's weights value for value against independent decoders (``test_mxfp4.decode64`` from the e2m1/e8m0
definitions, compressed-tensors' own INT4 decompression), and ``plane_dots`` (two row bands against one activation)
against a float64 matrix-vector product, with scales on both sides of 128 (where MXFP4's folded scale stops and the
per-word rest R starts), K a multiple of the step or not.

Random bytes (every code), random scales; without a GPU the kernels run in Triton's CPU interpreter (conftest.py), so
shapes stay tiny. The seed is in every message (MOE_TEST_SEED=<n> replays one).
"""

import os
import random

import pytest
import torch
import triton
import triton.language as tl

import moe_kernels
from moe_kernels.mxfp4 import dequantize_mxfp4
from moe_kernels.planes_triton import PLANES, WORDS_PER_GROUP, plane_dots, plane_scales, plane_values, plane_words
from tests.moe_kernels.test_int4 import random_int4, reference_weight
from tests.moe_kernels.test_mxfp4 import decode64, random_mxfp4
from tests.moe_kernels.test_triton import DEVICE, rel_err

pytestmark = pytest.mark.skipif("triton" not in moe_kernels.available_backends(),
                                reason="triton needs CUDA or TRITON_INTERPRET=1")


@pytest.fixture
def seed() -> int:
    return int(os.environ.get("MOE_TEST_SEED") or random.SystemRandom().randrange(2**31))


def as_words(packed: torch.Tensor) -> torch.Tensor:
    """The kernels' view of 4-bit weights: MXFP4's uint8 bytes as int32 words, INT4's words as they are."""
    return packed.view(torch.int32) if packed.dtype == torch.uint8 else packed


@triton.jit
def _planes_decode_kernel(w_ptr, scale_ptr, out_ptr, n_size, k_size, stride_we, stride_wn, stride_se, stride_sn,
                          stride_oe, stride_on, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                          QUANT: tl.constexpr):
    # out[e, n, k] = W[e, n, k], one [BLOCK_N, BLOCK_K] step per program, plane by plane: plane_values * R.
    expert = tl.program_id(2).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_size
    k_start = tl.program_id(1) * BLOCK_K
    words, group, ok = plane_words(w_ptr, expert, offs_n, n_ok, k_start, k_size, stride_we, stride_wn, BLOCK_K,
                                   EVEN_K)
    a, b = plane_scales(scale_ptr, expert, offs_n, group, ok, stride_se, stride_sn, QUANT)
    ROUND_BF16: tl.constexpr = QUANT == 4 and scale_ptr.dtype.element_ty == tl.bfloat16
    first = (k_start + tl.arange(0, BLOCK_K // 32) * 32)[None, :, None] + (tl.arange(0, WORDS_PER_GROUP) * PLANES)[
        None, None, :]  # [1, G, 4]: the K of each word's plane 0
    row_ptrs = out_ptr + expert * stride_oe + offs_n[:, None, None] * stride_on
    for i in tl.static_range(PLANES):
        values = plane_values(words, i, a, QUANT, ROUND_BF16) * b
        tl.store(row_ptrs + first + i, values, mask=n_ok[:, None, None] & (first + i < k_size))


def _decode(packed: torch.Tensor, scales: torch.Tensor, block_k: int) -> torch.Tensor:
    """[E, N, K] float32 through ``_planes_decode_kernel`` (NaN where it wrote nothing)."""
    e, n, k = scales.shape[0], scales.shape[1], scales.shape[2] * 32
    words, s = as_words(packed).to(DEVICE), scales.to(DEVICE)
    out = torch.full((e, n, k), float("nan"), device=DEVICE)
    block_n = 16
    _planes_decode_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k), e)](
        words, s, out, n, k, words.stride(0), words.stride(1), s.stride(0), s.stride(1), out.stride(0), out.stride(1),
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, QUANT=3 if packed.dtype == torch.uint8 else 4)
    return out.cpu()


@pytest.mark.parametrize("block_k", [32, 64])
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")  # scales 253, 254: inf
def test_mxfp4_planes_decode_is_exact(block_k, seed):
    """Every weight of every plane is ``decode64``'s value: all 256 bytes (every code in both nibbles: -0, the
    subnormal 0.5, 6), scales across e8m0's range (0: 2**-127; 128, where the folded scale stops; 129 .. 254, which
    need the rest R, up to where the largest codes overflow to inf), N and K past the last full step."""
    gen = torch.Generator().manual_seed(seed)
    E, N, K = 2, 24, 160  # noqa: N806 (K a multiple of 32, not of 64)
    packed, scales = random_mxfp4(gen, E, N, K)
    packed.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)[torch.randperm(256, generator=gen)]
    extremes = torch.tensor([0, 1, 2, 64, 126, 127, 128, 129, 130, 200, 252, 253, 254], dtype=torch.uint8)
    scales.view(-1)[:extremes.numel()] = extremes
    scales.view(-1)[extremes.numel():extremes.numel() + 16] = torch.randint(0, 255, (16,), generator=gen)
    got, want = _decode(packed, scales, block_k).double(), decode64(packed, scales)
    finite = want.abs() < 2.0**128
    assert torch.equal(got[finite], want[finite]), (
        f"seed {seed}: {(got[finite] != want[finite]).sum()} values differ, first at "
        f"{(got != want).logical_and(finite).nonzero()[:1].tolist()}")
    overflow = ~finite
    assert overflow.any() and torch.equal(got[overflow], want[overflow].sign() * torch.inf), f"seed {seed}"
    assert torch.equal(got[finite], dequantize_mxfp4(packed, scales, torch.float64)[finite]), f"seed {seed}"


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_int4_planes_decode_is_exact(scale_dtype, seed):
    """Every weight of every plane is compressed-tensors' decompressed value (bfloat16 scales: the product rounded
    to bfloat16, to nearest even), every integer -8..7 in every nibble position."""
    gen = torch.Generator().manual_seed(seed)
    packed, scales = random_int4(gen, 2, 24, 160)
    got = _decode(packed, scales.to(scale_dtype), 64).double()
    if scale_dtype == torch.bfloat16:
        want = reference_weight(packed, scales)
    else:  # float32 scales: the product exact in float32, as dequantize_int4 takes it
        want = moe_kernels.int4.dequantize_int4(packed, scales.float(), torch.float64)
    assert torch.equal(got, want), f"seed {seed}: {(got != want).sum()} values differ"


@triton.jit
def _plane_dots_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, half, k_size, stride_we, stride_wn, stride_se, stride_sn,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, QUANT: tl.constexpr,
                       TWO: tl.constexpr):
    # out[n] = W[0, n] @ x and, with TWO, out[half + n] = W[0, half + n] @ x: rows n < half, one band per program.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < half
    a, b = plane_dots(x_ptr, w_ptr, scale_ptr, 0, offs_n, half + offs_n, n_ok, k_size, stride_we, stride_wn,
                      stride_se, stride_sn, BLOCK_K, EVEN_K, QUANT, TWO)
    tl.store(out_ptr + offs_n, a, mask=n_ok)
    if TWO:
        tl.store(out_ptr + half + offs_n, b, mask=n_ok)


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
@pytest.mark.parametrize("k,block_k,two", [(128, 64, True), (160, 64, True), (96, 128, False)])
def test_plane_dots_vs_float64(fmt, k, block_k, two, seed):
    """Two row bands (w13's gate and up) or one (w2) against one activation, several steps along K (K a multiple of
    the step or not), rows past the last full band; MXFP4 scales 110 .. 145 (both sides of 128: R != 1 on some
    words) against a float64 matrix-vector product over the independently decoded weights."""
    gen = torch.Generator().manual_seed(seed)
    half = 40  # rows per band: not a multiple of BLOCK_N
    if fmt == "mxfp4":
        packed, _ = random_mxfp4(gen, 1, 2 * half, k)
        scales = torch.randint(110, 146, (1, 2 * half, k // 32), dtype=torch.uint8, generator=gen)
        weight = decode64(packed, scales)[0]
    else:
        packed, scales = random_int4(gen, 1, 2 * half, k)
        weight = reference_weight(packed, scales)[0]
    x = torch.randn(k, generator=gen)
    words, s = as_words(packed).to(DEVICE), scales.to(DEVICE)
    out = torch.full((2 * half,), float("nan"), device=DEVICE)
    block_n = 16
    _plane_dots_kernel[(triton.cdiv(half, block_n),)](
        x.to(DEVICE), words, s, out, half, k, words.stride(0), words.stride(1), s.stride(0), s.stride(1),
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, QUANT=3 if fmt == "mxfp4" else 4, TWO=two)
    rows = 2 * half if two else half
    want = weight[:rows] @ x.double()
    got = out.cpu()[:rows]
    assert rel_err(got, want) <= 1e-6, f"seed {seed}: relative error {rel_err(got, want)}"
    if not two:
        assert out[half:].isnan().all(), "one band writes only its own rows"
