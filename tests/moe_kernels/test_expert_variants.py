"""Expert biases and gpt-oss's clamped SwiGLU in every MoE backend, float and 8-bit, against a float64 loop.

The reference is written from gpt-oss's definition (per token, per chosen expert, with the gate clamped from above,
up clamped both ways, ``(up + 1) * gate * sigmoid(alpha * gate)``, biases inside the routing weight), not from our
kernels' code. Weights, biases and routing are fresh random each run; the seed is in every message. Gate and up
are scaled so that a good share of them lands beyond the clamp limit, which the test asserts.
"""

import os
import random

import pytest
import torch

import moe_kernels
from moe_kernels.activation import ExpertActivation
from moe_kernels.launch_config import GemmConfig, LaunchConfig
from moe_kernels.quant import QuantScheme, dequantize, quantize
from moe_kernels.triton_backend import fused_moe_triton
from tests.moe_kernels.test_triton import DEVICE

ACT = ExpertActivation("clamped_swiglu", alpha=1.702, limit=1.5)


@pytest.fixture
def seed() -> int:
    return int(os.environ.get("MOE_TEST_SEED") or random.SystemRandom().randrange(2**31))


def make(seed, T=5, E=6, k=2, H=32, I=16, spread=3.0):  # noqa: E741
    """Random inputs, weights, expert biases and routing; gate/up values of std ``spread``: past the limit often."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    w13 = torch.randn(E, 2 * I, H, generator=gen) * (spread / H**0.5)
    w2 = torch.randn(E, H, I, generator=gen) / I**0.5
    b13 = torch.randn(E, 2 * I, generator=gen)
    b2 = torch.randn(E, H, generator=gen)
    weights, ids = moe_kernels.route(torch.randn(T, E, generator=gen), k, renormalize=True)
    return x, w13, w2, b13, b2, weights, ids


def clamped_act(gate_up: torch.Tensor, act: ExpertActivation) -> tuple[torch.Tensor, int]:
    """One expert's float64 gate then up values [2I] -> (the activation [I], how many values its clamps cut), from
    the definitions: gpt-oss's ``clamped_swiglu`` clamps the gate from above and up both ways, then
    (up + 1) * gate * sigmoid(alpha * gate); Step-3.7-Flash's ``clamped_silu`` clamps silu(gate) from above and up
    both ways, then multiplies them."""
    gate, up = gate_up.chunk(2)
    if act.kind == "clamped_silu":
        silu = gate * torch.sigmoid(gate)
        cut = int((silu > act.limit).sum() + (up.abs() > act.limit).sum())
        return silu.clamp(max=act.limit) * up.clamp(-act.limit, act.limit), cut
    assert act.kind == "clamped_swiglu", act
    cut = int((gate > act.limit).sum() + (up.abs() > act.limit).sum())
    gate, up = gate.clamp(max=act.limit), up.clamp(-act.limit, act.limit)
    return (up + 1) * gate * torch.sigmoid(act.alpha * gate), cut


def reference(x, w13, w2, b13, b2, weights, ids, act=ACT):
    """float64, one (token, expert) at a time, from the definition; ``b13``/``b2`` None: no expert biases.
    -> (out, how many values the clamps cut)."""
    x, w13, w2 = (t.double() for t in (x, w13, w2))
    out = torch.zeros_like(x)
    clamped = 0
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = w13[e] @ x[t] + (0 if b13 is None else b13[e].double())
            h, cut = clamped_act(gate_up, act)
            clamped += cut
            out[t] += float(weights[t, j]) * (w2[e] @ h + (0 if b2 is None else b2[e].double()))
    return out, clamped


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def launch(gemv: bool) -> LaunchConfig:
    gemm = GemmConfig(16, 16, 1, num_warps=4, num_stages=2)
    return LaunchConfig(True, 16, gemm, gemm, gemv)


def test_torch_paths_float(seed):
    x, w13, w2, b13, b2, weights, ids = make(seed)
    ref, clamped = reference(x, w13, w2, b13, b2, weights, ids)
    assert clamped > 10, f"seed={seed}: the inputs must exercise the clamp"
    for backend in ("torch-loop", "torch"):  # "torch" on float32 CPU at this size is the grouped path
        out = moe_kernels.fused_moe(x, w13, w2, weights, ids, backend=backend, activation=ACT,
                                    w13_bias=b13, w2_bias=b2)
        assert rel_err(out, ref) < 1e-5, f"seed={seed} {backend}"
    no_bias = moe_kernels.fused_moe(x, w13, w2, weights, ids, backend="torch", activation=ACT)
    assert rel_err(no_bias, ref) > 1e-2, f"seed={seed}: the biases must matter"


@pytest.mark.parametrize("gemv", [False, True], ids=["grouped", "gemv"])
def test_triton_float(seed, gemv):
    x, w13, w2, b13, b2, weights, ids = make(seed)
    ref, _ = reference(x, w13, w2, b13, b2, weights, ids)
    args = [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]  # compiled kernels on a GPU, interpreted without
    out = fused_moe_triton(*args, ACT, config=launch(gemv), w13_bias=b13.to(DEVICE), w2_bias=b2.to(DEVICE))
    assert rel_err(out.cpu(), ref) < 1e-5, f"seed={seed} gemv={gemv}"


@pytest.mark.parametrize("scheme", [QuantScheme("int8"), QuantScheme("fp8", (16, 16))], ids=["int8", "fp8-block"])
@pytest.mark.parametrize("backend", ["torch", "triton-grouped", "triton-gemv"])
def test_quantized(seed, scheme, backend):
    """8-bit weights with float biases: the same result as the float64 loop over the dequantized weights."""
    x, w13, w2, b13, b2, weights, ids = make(seed)
    q13, s13 = zip(*(quantize(w, scheme, 2) for w in w13))
    q2, s2 = zip(*(quantize(w, scheme, 1) for w in w2))
    q13, s13, q2, s2 = torch.stack(q13), torch.stack(s13), torch.stack(q2), torch.stack(s2)
    deq13 = torch.stack([dequantize(q, s, scheme.block, torch.float64, 2) for q, s in zip(q13, s13)])
    deq2 = torch.stack([dequantize(q, s, scheme.block, torch.float64, 1) for q, s in zip(q2, s2)])
    ref, _ = reference(x, deq13, deq2, b13, b2, weights, ids)
    scales = dict(w13_scale=s13, w2_scale=s2, block_shape=scheme.block, w13_bias=b13, w2_bias=b2)
    if backend == "torch":
        out = moe_kernels.fused_moe(x, q13, q2, weights, ids, backend="torch", activation=ACT, **scales)
    else:
        on_device = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in scales.items()}
        args = [t.to(DEVICE) for t in (x, q13, q2, weights, ids)]
        out = fused_moe_triton(*args, ACT, config=launch(backend.endswith("gemv")), **on_device).cpu()
    assert rel_err(out, ref) < 1e-5, f"seed={seed} {scheme} {backend}"


def test_bad_activation_and_bias_shapes():
    x, w13, w2, b13, b2, weights, ids = make(0, I=8)
    with pytest.raises(ValueError, match="activation"):
        ExpertActivation("relu")
    with pytest.raises(ValueError, match="w2_bias"):
        moe_kernels.fused_moe(x, w13, w2, weights, ids, w2_bias=b13)
