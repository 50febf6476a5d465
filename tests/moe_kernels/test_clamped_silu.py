"""Step-3.7-Flash's clamped SwiGLU (``clamped_silu``) in every MoE backend and in the dense MLP, against a float64
loop written from its definition: silu(gate) clamped from above at the limit, times up clamped to [-limit, limit].
Gate and up are scaled so that a good share lands beyond the limit, which the test asserts."""

import os
import random

import pytest
import torch

import moe_kernels
from engine.layers.mlp import GatedMLP
from moe_kernels.activation import ExpertActivation
from moe_kernels.triton_backend import fused_moe_triton
from tests.moe_kernels.test_expert_variants import launch, rel_err
from tests.moe_kernels.test_triton import DEVICE

ACT = ExpertActivation("clamped_silu", limit=0.8)


@pytest.fixture
def seed() -> int:
    return int(os.environ.get("MOE_TEST_SEED") or random.SystemRandom().randrange(2**31))


def make(seed, T=5, E=6, k=2, H=32, I=16):  # noqa: E741
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    w13 = torch.randn(E, 2 * I, H, generator=gen) * (2 / H**0.5)  # gate/up of std ~2: past the limit often
    w2 = torch.randn(E, H, I, generator=gen) / I**0.5
    weights, ids = moe_kernels.route(torch.randn(T, E, generator=gen), k, renormalize=True)
    return x, w13, w2, weights, ids


def swiglu(gate_up: torch.Tensor, limit: float) -> tuple[torch.Tensor, int]:
    """float64 [2I] -> ([I], how many values the clamps cut)."""
    gate, up = gate_up.chunk(2)
    silu = gate * torch.sigmoid(gate)
    cut = int((silu > limit).sum() + (up.abs() > limit).sum())
    return silu.clamp(max=limit) * up.clamp(-limit, limit), cut


def reference(x, w13, w2, weights, ids):
    x, w13, w2 = (t.double() for t in (x, w13, w2))
    out, cut = torch.zeros_like(x), 0
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h, c = swiglu(w13[e] @ x[t], ACT.limit)
            out[t] += float(weights[t, j]) * (w2[e] @ h)
            cut += c
    return out, cut


def test_torch_paths_and_dense_mlp(seed):
    x, w13, w2, weights, ids = make(seed)
    ref, cut = reference(x, w13, w2, weights, ids)
    assert cut > 10, f"seed={seed}: the inputs must exercise the clamp"
    for backend in ("torch-loop", "torch"):
        out = moe_kernels.fused_moe(x, w13, w2, weights, ids, backend=backend, activation=ACT)
        assert rel_err(out, ref) < 1e-5, f"seed={seed} {backend}"
    plain = moe_kernels.fused_moe(x, w13, w2, weights, ids, backend="torch")
    assert rel_err(plain, ref) > 1e-2, f"seed={seed}: the clamp must matter"
    mlp = GatedMLP(32, 16, activation=ACT)
    with torch.no_grad():
        mlp.gate_up_proj.weight.copy_(w13[0])
        mlp.down_proj.weight.copy_(w2[0])
        want = torch.stack([w2[0].double() @ swiglu(w13[0].double() @ row, ACT.limit)[0] for row in x.double()])
        assert rel_err(mlp(x), want) < 1e-5, f"seed={seed}"


def test_triton(seed):
    """The grouped-GEMM kernel (the gemv kernels apply the same ``gated_act``)."""
    x, w13, w2, weights, ids = make(seed, E=4, I=8)  # few programs: the interpreter runs each on the CPU
    ref, _ = reference(x, w13, w2, weights, ids)
    args = [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]  # compiled kernels on a GPU, interpreted without
    out = fused_moe_triton(*args, ACT, config=launch(False))
    assert rel_err(out.cpu(), ref) < 1e-5, f"seed={seed}"
