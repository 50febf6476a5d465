"""MXFP4 expert weights: the format against a float64 decoder written here from the e2m1/e8m0 definitions, and the
torch and Triton MoE paths (gpt-oss's biases and clamped SwiGLU, top-2, an expert with no tokens) against the
float64 loop of ``test_expert_variants`` on the decoded weights.

Weights are random bytes (every nibble code, both signs) with random scales over a realistic exponent range;
without a GPU the Triton kernels run in Triton's CPU interpreter (conftest.py), so shapes stay tiny. The seed is in
every message (MOE_TEST_SEED=<n> replays one).
"""

import os
import random

import pytest
import torch

import moe_kernels
from moe_kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from moe_kernels.quant import QuantScheme, dequantize
from tests.moe_kernels.test_expert_variants import ACT, reference, rel_err
from tests.moe_kernels.test_triton import DEVICE, cfg


@pytest.fixture
def seed() -> int:
    return int(os.environ.get("MOE_TEST_SEED") or random.SystemRandom().randrange(2**31))


def decode64(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """packed uint8 [.., N, K/2], scales uint8 [.., N, K/32] -> float64 [.., N, K], from the definitions: code
    s eem (sign, 2 exponent bits, 1 mantissa bit), subnormal m/2 when ee = 0, else (1 + m/2) * 2**(ee - 1); element
    2j in the low nibble of byte j; times 2**(scale - 127) for each run of 32 along K."""
    p = packed.cpu().long()
    codes = torch.stack([p & 15, p >> 4], dim=-1).flatten(-2)  # [.., N, K]
    sign = 1.0 - 2.0 * (codes >> 3).double()
    ee, m = ((codes >> 1) & 3).double(), (codes & 1).double()
    mag = torch.where(ee == 0, m / 2, (1 + m / 2) * torch.pow(2.0, ee - 1))
    scale = torch.pow(2.0, scales.cpu().double() - 127).repeat_interleave(32, dim=-1)
    return sign * mag * scale


def random_mxfp4(gen, *shape):
    """Random packed bytes and scales for a weight of ``shape`` [.., N, K]: exponents 2**-9 .. 2**-1, as the
    published gpt-oss experts mostly have."""
    *lead, n, k = shape
    packed = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, generator=gen)
    scales = torch.randint(118, 127, (*lead, n, k // 32), dtype=torch.uint8, generator=gen)
    return packed, scales


def test_dequantize_and_quantize_vs_float64(seed):
    gen = torch.Generator().manual_seed(seed)
    packed, scales = random_mxfp4(gen, 3, 5, 96)
    want = decode64(packed, scales)
    assert torch.equal(dequantize(packed, scales, None, torch.float32).double(), want), f"seed {seed}"
    assert torch.equal(dequantize(packed, scales, None, torch.bfloat16).double(), want), f"seed {seed}"
    scales[0, 0, 0], scales[0, 0, 1] = 0, 254  # e8m0's smallest scale, 2**-127, and its largest finite one
    assert torch.equal(dequantize_mxfp4(packed, scales, torch.float64), decode64(packed, scales)), f"seed {seed}"
    # Quantizing MXFP4 values (a checkpoint dequantized as read) gives back the same values.
    assert torch.equal(decode64(*quantize_mxfp4(want)), want), f"seed {seed}"
    # Any weights: each value within half the widest e2m1 step (2) times its group's scale, the smallest power of
    # two that brings the group's largest magnitude within 6 (so in (3, 6] times it).
    w = torch.randn(4, 6, 64, generator=gen) * torch.exp2(torch.randint(-8, 4, (4, 6, 1), generator=gen))
    q, s = quantize_mxfp4(w)
    step = torch.pow(2.0, s.double() - 127).repeat_interleave(32, dim=-1)
    assert ((decode64(q, s) - w.double()).abs() <= step + 1e-30).all(), f"seed {seed}"
    ratio = w.double().abs().unflatten(-1, (2, 32)).amax(-1) / torch.pow(2.0, s.double() - 127)
    assert ((ratio > 3) & (ratio <= 6)).all(), f"seed {seed}"


# (backend, dtype, T): token counts 1 (a decode, which MXFP4 sends to the grouped kernels) and 7 (a prefill).
CASES = [("torch", torch.float32, 7), ("triton-sorted", torch.float32, 7), ("triton-unsorted", torch.bfloat16, 1),
         ("triton-sorted", torch.bfloat16, 7)]
PATHS = {"sorted": cfg(True, block_k=64), "unsorted": cfg(False)}


@pytest.mark.parametrize("backend,dtype,T", CASES)
def test_fused_moe_mxfp4_vs_float64(backend, dtype, T, seed):  # noqa: N803
    if backend != "torch" and "triton" not in moe_kernels.available_backends():
        pytest.skip("triton needs CUDA or TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(seed)
    E, k, H, I = 4, 2, 64, 32  # noqa: E741, N806
    q13, s13 = random_mxfp4(gen, E, 2 * I, H)
    q2, s2 = random_mxfp4(gen, E, H, I)
    x = torch.randn(T, H, generator=gen).to(dtype)
    b13, b2 = torch.randn(E, 2 * I, generator=gen), torch.randn(E, H, generator=gen)
    logits = torch.randn(T, E, generator=gen)
    logits[:, E - 1] = -torch.inf  # the last expert gets no tokens
    weights, ids = moe_kernels.route(logits, k, renormalize=True)
    args = [t.to(DEVICE) for t in (x, q13, q2, weights, ids)]
    quant = dict(w13_scale=s13.to(DEVICE), w2_scale=s2.to(DEVICE), w13_bias=b13.to(DEVICE, dtype),
                 w2_bias=b2.to(DEVICE, dtype), activation=ACT)
    if backend == "torch":
        out = moe_kernels.fused_moe(*args, backend="torch", **quant)
    else:
        from moe_kernels.triton_backend import fused_moe_triton

        out = fused_moe_triton(*args, config=PATHS[backend.split("-", 1)[1]], **quant)
    ref, clamped = reference(x, decode64(q13, s13), decode64(q2, s2), b13.to(dtype), b2.to(dtype), weights, ids)
    assert clamped > 0, f"seed {seed}: the clamp was never reached"
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16: the intermediate is rounded to bfloat16
    assert rel_err(out.cpu(), ref) <= tol, f"seed {seed}: relative error {rel_err(out.cpu(), ref)}"


def test_mxfp4_errors_name_the_field():
    gen = torch.Generator().manual_seed(0)
    q13, s13 = random_mxfp4(gen, 2, 64, 64)
    q2, s2 = random_mxfp4(gen, 2, 64, 32)
    x, (weights, ids) = torch.randn(3, 64), moe_kernels.route(torch.randn(3, 2), 1)
    with pytest.raises(ValueError, match="w13_scale"):
        moe_kernels.fused_moe(x, q13, q2, weights, ids, w13_scale=s13[..., :1], w2_scale=s2)
    with pytest.raises(ValueError, match="w2_scale"):
        moe_kernels.fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=None)
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantScheme("mxfp4").stored_shape((4, 48))
