"""MXFP4 expert weights: the format and the Triton kernels' tile decode (value for value) against a float64 decoder
written here from the e2m1/e8m0 definitions, and the torch and Triton MoE paths (gpt-oss's biases and clamped
SwiGLU, top-2, an expert with no tokens; several scale groups along K) against the float64 loops of
``test_expert_variants`` and ``test_triton`` on the decoded weights.

Weights are random bytes (every nibble code, both signs) with random scales over a realistic exponent range;
without a GPU the Triton kernels run in Triton's CPU interpreter (conftest.py), so shapes stay tiny. The seed is in
every message (MOE_TEST_SEED=<n> replays one).
"""

import json
import os
import random

import pytest
import torch
import triton
import triton.language as tl

import moe_kernels
from moe_kernels import triton_backend
from moe_kernels.launch_config import (
    ENV_CONFIG_DIR, config_file_name, device_name, get_launch_config, quantization_name,
)
from moe_kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from moe_kernels.mxfp4_triton import mxfp4_tile
from moe_kernels.quant import QuantScheme, dequantize
from tests.moe_kernels.test_expert_variants import ACT, reference, rel_err
from moe_kernels.triton_backend import INTERPRETED, fused_moe_triton
from tests.moe_kernels.test_triton import DEVICE, cfg, moe_float64_loop


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


# (backend, dtype, T): token counts 1 and 3 (decodes: unsorted grouped kernels or matrix-vector kernels, their 4-bit
# tiles in K order or as nibble planes) and 7.
CASES = [("torch", torch.float32, 7), ("triton-sorted", torch.float32, 7), ("triton-unsorted", torch.bfloat16, 1),
         ("triton-sorted", torch.bfloat16, 7), ("triton-gemv", torch.float32, 3), ("triton-gemv", torch.bfloat16, 1),
         ("triton-gemv-planes", torch.float32, 3), ("triton-gemv-planes", torch.bfloat16, 1),
         ("triton-swap", torch.bfloat16, 7), ("triton-swap-split", torch.float32, 7)]
# gemv-planes steps 32 at a time: K a multiple of the step (EVEN_K) here, not in the scale-group test's shape.
PATHS = {"sorted": cfg(True, block_k=64), "unsorted": cfg(False), "gemv": cfg(False, block_k=64, gemv=True),
         "gemv-planes": cfg(False, block_k=32, gemv=True, planes=True),
         "swap": cfg(True, block_k=64, swap=True), "swap-split": cfg(True, block_k=32, swap=True, split_k=2)}


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


@triton.jit
def _decode_kernel(w_ptr, scale_ptr, out_ptr, n_size, k_size, stride_we, stride_wn, stride_se, stride_sn, stride_oe,
                   stride_on, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    # out[e, n, k] = W[e, n, k] for one [BLOCK_N, BLOCK_K] tile per program, through mxfp4_tile.
    expert = tl.program_id(2).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = offs_n < n_size
    tile = mxfp4_tile(w_ptr, scale_ptr, expert, offs_n, n_ok, tl.program_id(1) * BLOCK_K, k_size, stride_we,
                      stride_wn, stride_se, stride_sn, BLOCK_K, EVEN_K)
    tl.store(out_ptr + expert * stride_oe + offs_n[:, None] * stride_on + offs_k[None, :], tile,
             mask=n_ok[:, None] & (offs_k < k_size)[None, :])


@pytest.mark.parametrize("block_k", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")  # scales 253, 254: inf
def test_tile_decode_is_exact(block_k, dtype, seed):
    """The kernels' tile decode, value for value, against the float64 decoder: all 256 bytes (every code in both
    nibbles: -0, the subnormal 0.5, 6), scales across e8m0's range (0: 2**-127, a float32 subnormal, up to 254,
    where the largest codes overflow to inf), N and K past the last full tile (K a multiple of 32, not of 64)."""
    if "triton" not in moe_kernels.available_backends():
        pytest.skip("triton needs CUDA or TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(seed)
    E, N, K, block_n = 2, 24, 160, 16  # noqa: N806
    packed, scales = random_mxfp4(gen, E, N, K)
    packed.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)[torch.randperm(256, generator=gen)]
    extremes = torch.tensor([0, 1, 2, 64, 126, 127, 128, 129, 200, 252, 253, 254], dtype=torch.uint8)
    scales.view(-1)[:extremes.numel()] = extremes
    scales.view(-1)[extremes.numel():extremes.numel() + 8] = torch.randint(0, 255, (8,), generator=gen)
    out = torch.full((E, N, K), float("nan"), dtype=dtype, device=DEVICE)
    grid = (triton.cdiv(N, block_n), triton.cdiv(K, block_k), E)
    q, s = packed.to(DEVICE), scales.to(DEVICE)
    _decode_kernel[grid](q, s, out, N, K, q.stride(0), q.stride(1), s.stride(0), s.stride(1), out.stride(0),
                         out.stride(1), BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=K % block_k == 0)
    got, want = out.cpu().double(), decode64(packed, scales)
    finite = want.abs() < 2.0**128  # float32 and bfloat16 hold every value below 2**128 exactly
    if INTERPRETED and dtype == torch.bfloat16:  # the interpreter's float32 -> bfloat16 flushes subnormals to 0
        finite &= (want == 0) | (want.abs() >= 2.0**-126)
    assert torch.equal(got[finite], want[finite]), (
        f"seed {seed}: {(got[finite] != want[finite]).sum()} values differ, first at "
        f"{(got != want).logical_and(finite).nonzero()[:1].tolist()}")
    overflow = want.abs() >= 2.0**128
    assert overflow.any() and torch.equal(got[overflow], want[overflow].sign() * torch.inf), f"seed {seed}"
    assert torch.equal(got[finite], dequantize_mxfp4(packed, scales, dtype).double()[finite]), f"seed {seed}"


@pytest.mark.parametrize("path", ["sorted", "unsorted", "gemv", "gemv-planes", "swap", "swap-split"])
def test_fused_moe_scale_groups_vs_float64(path, seed):
    """Weights of several scale groups along K (5 along H, 3 along I), a different scale for each group of a row,
    every code (random bytes), K not a multiple of BLOCK_K: the Triton paths against the float64 loop on
    ``dequantize_mxfp4``'s float64 values. A swapped nibble or a scale read from the wrong group is far off."""
    if "triton" not in moe_kernels.available_backends():
        pytest.skip("triton needs CUDA or TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(seed)
    T, E, k, H, I = 3, 3, 2, 160, 96  # noqa: E741, N806
    weights = {}
    for name, (n, kdim) in {"w13": (2 * I, H), "w2": (H, I)}.items():
        packed, _ = random_mxfp4(gen, E, n, kdim)
        groups = kdim // 32  # a permutation of 118 .. 118 + groups - 1 per row: every group its own scale
        scales = (118 + torch.rand(E, n, groups, generator=gen).argsort(dim=-1)).to(torch.uint8)
        weights[name] = packed, scales
    x = torch.randn(T, H, generator=gen)
    topk_weights, ids = moe_kernels.route(torch.randn(T, E, generator=gen), k, renormalize=True)
    (q13, s13), (q2, s2) = weights["w13"], weights["w2"]
    on = [t.to(DEVICE) for t in (x, q13, q2, topk_weights, ids)]
    out = fused_moe_triton(*on, config=PATHS[path], w13_scale=s13.to(DEVICE), w2_scale=s2.to(DEVICE))
    ref = moe_float64_loop(x, dequantize_mxfp4(q13, s13, torch.float64), dequantize_mxfp4(q2, s2, torch.float64),
                           topk_weights, ids)
    assert rel_err(out.cpu(), ref) <= 1e-5, f"seed {seed}: relative error {rel_err(out.cpu(), ref)}"


def test_mxfp4_block_k_whole_scale_groups(tmp_path, monkeypatch, seed):
    """MXFP4 tiles hold whole groups of 32 along K: a given config with BLOCK_K 16 is refused; a config file with
    BLOCK_K 16 is raised to 32 when looked up for MXFP4 weights, and the result is right."""
    if "triton" not in moe_kernels.available_backends():
        pytest.skip("triton needs CUDA or TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(seed)
    T, E, k, H, I = 2, 3, 2, 96, 64  # noqa: E741, N806 (a shape no other test looks up)
    (q13, s13), (q2, s2) = random_mxfp4(gen, E, 2 * I, H), random_mxfp4(gen, E, H, I)
    x = torch.randn(T, H, generator=gen)
    topk_weights, ids = moe_kernels.route(torch.randn(T, E, generator=gen), k, renormalize=True)
    on = [t.to(DEVICE) for t in (x, q13, q2, topk_weights, ids)]
    scales = dict(w13_scale=s13.to(DEVICE), w2_scale=s2.to(DEVICE))
    with pytest.raises(ValueError, match="BLOCK_K a multiple of 32"):
        fused_moe_triton(*on, config=cfg(True, block_k=16), **scales)
    name = config_file_name(E, 2 * I, H, torch.float32, device_name(DEVICE))
    (tmp_path / name).write_text(json.dumps({"configs": {"1": cfg(True, block_k=16).to_dict()}}))
    monkeypatch.setenv(ENV_CONFIG_DIR, str(tmp_path))
    out = fused_moe_triton(*on, **scales)
    ref = moe_float64_loop(x, decode64(q13, s13), decode64(q2, s2), topk_weights, ids)
    assert rel_err(out.cpu(), ref) <= 1e-5, f"seed {seed}: relative error {rel_err(out.cpu(), ref)}"


def test_mxfp4_weights_launch_with_their_own_config_file(tmp_path, monkeypatch, seed):
    """A file under the MXFP4 name in $MOEGATE_MOE_CONFIG_DIR (where ``benchmarks.tune_moe --quantization mxfp4``
    writes) is the config ``fused_moe_triton`` launches MXFP4 weights with, beside a file for the same shape in the
    activation dtype, which float weights keep; without an MXFP4 file, MXFP4 weights fall back to the dtype's."""
    if "triton" not in moe_kernels.available_backends():
        pytest.skip("triton needs CUDA or TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(seed)
    T, E, k, H, I = 2, 5, 2, 64, 32  # noqa: E741, N806 (a shape no other test looks up)
    device = device_name(DEVICE)
    mine, theirs = cfg(True, block_n=16, block_k=64), cfg(True, block_n=32, block_k=32)
    assert quantization_name(torch.uint8) == "mxfp4" and quantization_name(torch.float32) is None
    assert quantization_name(torch.int8) is None  # 8-bit weights keep the dtype's files
    both, dtype_only = tmp_path / "both", tmp_path / "dtype_only"
    for folder in (both, dtype_only):
        folder.mkdir()
        (folder / config_file_name(E, 2 * I, H, torch.float32, device)).write_text(
            json.dumps({"configs": {"1": theirs.to_dict()}}))
    mxfp4_file = both / config_file_name(E, 2 * I, H, torch.float32, device, "mxfp4")
    safe = device.replace(" ", "_")  # a GPU's name ("NVIDIA H200") as file names carry it
    assert mxfp4_file.name == f"E={E},N={2 * I},K={H},dtype=float32,quantization=mxfp4,device={safe}.json"
    mxfp4_file.write_text(json.dumps({"configs": {"1": mine.to_dict()}}))

    monkeypatch.setenv(ENV_CONFIG_DIR, str(both))
    assert get_launch_config(E, 2 * I, H, torch.float32, device, T, "mxfp4") == mine
    assert get_launch_config(E, 2 * I, H, torch.float32, device, T) == theirs
    launched = []
    for name in ("invoke_w13", "invoke_w2"):  # record the GemmConfig (argument 5 of both) each kernel launches with
        real = getattr(triton_backend, name)
        monkeypatch.setattr(triton_backend, name, lambda *a, _f=real, **kw: launched.append(a[5]) or _f(*a, **kw))
    (q13, s13), (q2, s2) = random_mxfp4(gen, E, 2 * I, H), random_mxfp4(gen, E, H, I)
    x = torch.randn(T, H, generator=gen)
    topk_weights, ids = moe_kernels.route(torch.randn(T, E, generator=gen), k, renormalize=True)
    triton_backend._cached_config.cache_clear()  # keyed by shape, not by folder
    out = fused_moe_triton(*[t.to(DEVICE) for t in (x, q13, q2, topk_weights, ids)], w13_scale=s13.to(DEVICE),
                           w2_scale=s2.to(DEVICE))
    assert launched == [mine.w13, mine.w2]
    ref = moe_float64_loop(x, decode64(q13, s13), decode64(q2, s2), topk_weights, ids)
    assert rel_err(out.cpu(), ref) <= 1e-5, f"seed {seed}: relative error {rel_err(out.cpu(), ref)}"

    monkeypatch.setenv(ENV_CONFIG_DIR, str(dtype_only))
    assert get_launch_config(E, 2 * I, H, torch.float32, device, T, "mxfp4") == theirs
