"""8-bit expert weights: quantize/dequantize against a float64 routine written here, and the torch and Triton
MoE paths against dequantize-then-matmul in float64.

Without a GPU the Triton kernels run in Triton's CPU interpreter (conftest.py), which loads float8_e4m3fn
and int8 tensors as a GPU does; shapes stay tiny. Inputs are fresh random each run; the seed is in every
assertion message (MOE_TEST_SEED=<n> replays one).
"""

import itertools
import math
import os
import random

import pytest
import torch

import moe_kernels
from moe_kernels.quant import FP8_DTYPE, QuantScheme, dequantize, quantize, scale_shape
from tests.moe_kernels.test_triton import cfg, make_inputs, moe_float64_loop

SCHEMES = {
    "int8": QuantScheme("int8"),
    "fp8": QuantScheme("fp8"),
    "fp8-block": QuantScheme("fp8", (16, 32)),  # small blocks so the tiny shapes hold several, edges cut
}


@pytest.fixture
def seed() -> int:
    return int(os.environ.get("MOE_TEST_SEED") or random.SystemRandom().randrange(2**31))


def scales64(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Per element scale [.., N, K] of ``w``, by the definition (largest magnitude of the group over the format's
    largest value), one element at a time in float64."""
    limit = 448.0 if scheme.method == "fp8" else 127.0
    w = w.double()
    *lead, n, k = w.shape
    out = torch.empty_like(w)
    for idx in itertools.product(*(range(d) for d in lead)):
        for r in range(n):
            for c in range(k):
                if scheme.block is None:
                    group = w[idx][r]
                else:
                    bn, bk = scheme.block
                    group = w[idx][r // bn * bn:(r // bn + 1) * bn, c // bk * bk:(c // bk + 1) * bk]
                amax = float(group.abs().max())
                out[idx][r, c] = amax / limit if amax > 0 else 1.0
    return out


def dequant64(q: torch.Tensor, scale: torch.Tensor, block, halves: int = 1) -> torch.Tensor:
    """q * its scale in float64, the scale spread by explicit indexing (independent of ``dequantize``); with
    ``halves`` 2 and blocks, each half of the rows has its own blocks."""
    if halves == 2 and block is not None:
        return torch.cat([dequant64(q_h, s_h, block) for q_h, s_h in zip(q.chunk(2, -2), scale.chunk(2, -2))], -2)
    *_, n, k = q.shape
    if block is None:
        return q.double() * scale.double()[..., :, None]
    rows = torch.arange(n) // block[0]
    cols = torch.arange(k) // block[1]
    return q.double() * scale.double()[..., rows[:, None], cols[None, :]]


@pytest.mark.parametrize("name", SCHEMES)
def test_quantize_round_trip_vs_float64(name, seed):
    scheme = SCHEMES[name]
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(2, 37, 70, generator=gen) * torch.rand(2, 37, 1, generator=gen) * 3  # rows of unequal range
    w[0, 5] = 0.0  # an all-zero channel
    q, scale = quantize(w, scheme)
    assert q.dtype == scheme.dtype and scale.dtype == torch.float32
    assert tuple(scale.shape) == scale_shape(tuple(w.shape), scheme.block)
    ref_scale = scales64(w, scheme)
    got_scale = dequant64(torch.ones_like(w), scale, scheme.block)
    assert torch.allclose(got_scale, ref_scale, rtol=1e-6, atol=0), f"seed {seed}"
    deq = dequant64(q, scale, scheme.block)
    err = (deq - w.double()).abs()
    if scheme.method == "int8":
        bound = ref_scale / 2  # round to nearest
        assert q.abs().max() <= 127
    else:  # e4m3: 3 mantissa bits (half a step is 2^-4 of the value), subnormal steps 2^-9 of the scale
        bound = torch.maximum(w.double().abs() * 2**-4, ref_scale * 2**-10)
    assert (err <= bound * (1 + 1e-6) + 1e-12).all(), f"seed {seed}: worst {float((err / bound).max())} of bound"
    # The library's own dequantize is the same product.
    assert torch.allclose(dequantize(q, scale, scheme.block, torch.float64), deq, rtol=1e-7, atol=0)


def quantized_inputs(seed, scheme, T=5, E=4, k=2, H=64, I=40, dtype=torch.float32):  # noqa: E741
    # I = 40: the up half of w13 starts inside a 16-row block, so its own blocks are checked.
    x, w13, w2, weights, ids = make_inputs(seed, T, E, k, H, I, dtype)
    q13, s13 = quantize(w13, scheme, halves=2)
    q2, s2 = quantize(w2, scheme)
    return x, (q13, s13), (q2, s2), weights, ids


# Triton paths: expert-sorted row blocks, one slot per block, matrix-vector kernels; BLOCK_K 64 is cut to the
# 32-wide scale blocks.
TRITON_PATHS = {"sorted": cfg(True, block_k=64), "unsorted": cfg(False), "gemv": cfg(gemv=True, block_k=64)}


@pytest.mark.parametrize("backend", ["torch", *(f"triton-{path}" for path in TRITON_PATHS)])
@pytest.mark.parametrize("name", SCHEMES)
def test_fused_moe_8bit_vs_dequantized_float64(backend, name, seed):
    scheme = SCHEMES[name]
    x, (q13, s13), (q2, s2), weights, ids = quantized_inputs(seed, scheme)
    quant = dict(w13_scale=s13, w2_scale=s2, block_shape=scheme.block)
    if backend == "torch":
        out = moe_kernels.fused_moe(x, q13, q2, weights, ids, backend=backend, **quant)
    else:
        if "triton" not in moe_kernels.available_backends():
            pytest.skip("triton needs CUDA or TRITON_INTERPRET=1")
        from moe_kernels.triton_backend import fused_moe_triton

        out = fused_moe_triton(x, q13, q2, weights, ids, config=TRITON_PATHS[backend.split("-", 1)[1]], **quant)
    ref = moe_float64_loop(x, dequant64(q13, s13, scheme.block, 2), dequant64(q2, s2, scheme.block), weights, ids)
    assert out.dtype == x.dtype
    err = (out.double().cpu() - ref).abs().max().item()
    assert err <= 1e-4 * max(1.0, ref.abs().max().item()), f"seed {seed}: max error {err}"


def test_fused_moe_int8_bfloat16_cpu(seed):
    """bfloat16 activations through torch's weight-only int8 matmul: within bfloat16 rounding of the reference."""
    x, (q13, s13), (q2, s2), weights, ids = quantized_inputs(seed, SCHEMES["int8"], dtype=torch.bfloat16)
    out = moe_kernels.fused_moe(x, q13, q2, weights, ids, backend="torch", w13_scale=s13, w2_scale=s2)
    ref = moe_float64_loop(x, dequant64(q13, s13, None), dequant64(q2, s2, None), weights, ids)
    err = (out.double().cpu() - ref).abs().max().item()
    assert err <= 3e-2 * max(1.0, ref.abs().max().item()), f"seed {seed}: max error {err}"


def test_scale_errors_name_the_field():
    x, (q13, s13), (q2, s2), weights, ids = quantized_inputs(0, SCHEMES["fp8"])
    with pytest.raises(ValueError, match="w13_scale"):
        moe_kernels.fused_moe(x, q13, q2, weights, ids, w13_scale=s13[:, :3], w2_scale=s2)
    with pytest.raises(ValueError, match="no w2_scale"):
        moe_kernels.fused_moe(x, q13, q2, weights, ids, w13_scale=s13)
    with pytest.raises(ValueError, match="block scales are for fp8"):
        QuantScheme("int8", (128, 128))
    assert q13.dtype == FP8_DTYPE and math.isfinite(float(s13.max()))
