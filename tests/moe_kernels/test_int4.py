"""INT4 expert weights (compressed-tensors' pack-quantized layout): the format against compressed-tensors' own
packer, unpacker and decompressor, and the torch and Triton MoE paths against a float64 loop on the weights
compressed-tensors decompresses.

Weights are random 4-bit integers (every value -8..7) with random bfloat16 scales, a different one for each group of
32 along K; without a GPU the Triton kernels run in Triton's CPU interpreter (conftest.py), so shapes stay tiny. The
seed is in every message (MOE_TEST_SEED=<n> replays one).
"""

import os
import random

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

import moe_kernels
from moe_kernels import int4
from moe_kernels.quant import QuantScheme, dequantize
from moe_kernels.triton_backend import fused_moe_triton
from tests.moe_kernels.test_triton import DEVICE, cfg, moe_float64_loop, rel_err

SCHEME = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
    num_bits=4, type="int", symmetric=True, strategy="group", group_size=32))


@pytest.fixture
def seed() -> int:
    return int(os.environ.get("MOE_TEST_SEED") or random.SystemRandom().randrange(2**31))


def random_int4(gen, *shape):
    """(packed int32 [.., N, K/8] by compressed-tensors' packer, bfloat16 scales [.., N, K/32]) for a weight of
    ``shape``: every integer -8..7, scales 2**-9 .. 2**-3 (Kimi's experts' range)."""
    *lead, n, k = shape
    q = torch.randint(-8, 8, (*lead, n, k), dtype=torch.int8, generator=gen)
    scales = torch.exp2(torch.rand(*lead, n, k // 32, generator=gen) * 6 - 9).to(torch.bfloat16)
    return pack_to_int32(q, 4), scales


def reference_weight(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' own decompression of each [N, K/8] weight -> float64 [.., N, K]."""
    if packed.dim() > 2:
        return torch.stack([reference_weight(p, s) for p, s in zip(packed, scales)])
    shape = torch.tensor([packed.shape[0], packed.shape[1] * 8])
    state = {"weight_packed": packed, "weight_scale": scales, "weight_shape": shape}
    return PackedQuantizationCompressor.decompress(state, SCHEME)["weight"].double()


def test_format_vs_compressed_tensors(seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (5, 96), dtype=torch.int8, generator=gen)
    packed = pack_to_int32(q, 4)
    assert torch.equal(int4.pack_int4(q), packed), f"seed {seed}"
    assert torch.equal(int4.unpack_int4(packed), unpack_from_int32(packed, 4, torch.Size([5, 96]))), f"seed {seed}"
    packed, scales = random_int4(gen, 3, 5, 96)
    want = reference_weight(packed, scales)
    for dtype in (torch.float32, torch.bfloat16):  # rounded as compressed-tensors rounds: bit for bit in both
        assert torch.equal(dequantize(packed, scales, None, dtype).double(), want), f"seed {seed}"
    # quantize_int4's integers are compressed-tensors' for the same scales; each value within half a step, plus
    # what bfloat16 costs: a scale rounded down can push a group's largest value past 7.5 steps (clamped to 7,
    # 7.5 * 2**-8 steps further), and the dequantized product is rounded (at most 8 * 2**-9 steps).
    w = torch.randn(4, 6, 64, generator=gen) * torch.exp2(torch.randint(-8, 4, (4, 6, 1), generator=gen))
    ours, s = int4.quantize_int4(w)
    for e in range(w.shape[0]):
        theirs = PackedQuantizationCompressor.compress({"weight": w[e], "weight_scale": s[e]}, SCHEME)
        assert torch.equal(ours[e], theirs["weight_packed"]), f"seed {seed}"
    step = s.double().repeat_interleave(32, dim=-1)
    assert ((int4.dequantize_int4(ours, s, torch.float64) - w.double()).abs() <= 0.56 * step).all(), f"seed {seed}"


# (path, dtype, T): decodes (gemv with tiles in K order or nibble planes, unsorted) and a prefill-sized sorted call,
# float32 and bfloat16.
CASES = [("torch", torch.float32, 5), ("torch", torch.bfloat16, 2), ("sorted", torch.float32, 7),
         ("sorted", torch.bfloat16, 7), ("unsorted", torch.bfloat16, 1), ("gemv", torch.float32, 3),
         ("gemv", torch.bfloat16, 1), ("gemv-planes", torch.float32, 3), ("gemv-planes", torch.bfloat16, 1)]
PATHS = {"sorted": cfg(True, block_k=64), "unsorted": cfg(False), "gemv": cfg(False, block_k=64, gemv=True),
         "gemv-planes": cfg(False, block_k=64, gemv=True, planes=True)}


@pytest.mark.parametrize("path,dtype,T", CASES)
def test_fused_moe_int4_vs_float64(path, dtype, T, seed):  # noqa: N803
    """Several scale groups along K (5 along H, 3 along I; K not a multiple of the tile's BLOCK_K of 64), top-2,
    an expert with no tokens: a swapped nibble, a wrong sign offset or a scale from the wrong group is far off."""
    if path != "torch" and "triton" not in moe_kernels.available_backends():
        pytest.skip("triton needs CUDA or TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(seed)
    E, k, H, I = 4, 2, 160, 96  # noqa: E741, N806
    q13, s13 = random_int4(gen, E, 2 * I, H)
    q2, s2 = random_int4(gen, E, H, I)
    x = torch.randn(T, H, generator=gen).to(dtype)
    logits = torch.randn(T, E, generator=gen)
    logits[:, E - 1] = -torch.inf  # the last expert gets no tokens
    weights, ids = moe_kernels.route(logits, k, renormalize=True)
    on = [t.to(DEVICE) for t in (x, q13, q2, weights, ids)]
    scales = dict(w13_scale=s13.to(DEVICE), w2_scale=s2.to(DEVICE))
    if path == "torch":
        out = moe_kernels.fused_moe(*on, backend="torch", **scales)
    else:
        out = fused_moe_triton(*on, config=PATHS[path], **scales)
    ref = moe_float64_loop(x, reference_weight(q13, s13), reference_weight(q2, s2), weights, ids)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16: the intermediate is rounded to bfloat16
    assert rel_err(out.cpu(), ref) <= tol, f"seed {seed}: relative error {rel_err(out.cpu(), ref)}"


def test_int4_errors_name_the_field():
    gen = torch.Generator().manual_seed(0)
    q13, s13 = random_int4(gen, 2, 64, 64)
    q2, s2 = random_int4(gen, 2, 64, 32)
    x, (weights, ids) = torch.randn(3, 64), moe_kernels.route(torch.randn(3, 2), 1)
    with pytest.raises(ValueError, match="w13_scale"):
        moe_kernels.fused_moe(x, q13, q2, weights, ids, w13_scale=s13[..., :1], w2_scale=s2)
    with pytest.raises(ValueError, match="w2_scale"):
        moe_kernels.fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2.to(torch.float16))
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantScheme("int4").stored_shape((4, 48))
    assert QuantScheme("int4").stored_shape((3, 8, 64)) == (3, 8, 8)
