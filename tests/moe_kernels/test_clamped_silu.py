"""Step-3.7-Flash's clamped SwiGLU (``clamped_silu``) in every MoE backend and in the dense MLP, against
``test_expert_variants``' float64 loop written from its definition: silu(gate) clamped from above at the limit,
times up clamped to [-limit, limit]; no expert biases. Gate and up are scaled so that a good share lands beyond
the limit, which the test asserts."""

import torch

import moe_kernels
from engine.layers.mlp import GatedMLP
from moe_kernels.activation import ExpertActivation
from moe_kernels.triton_backend import fused_moe_triton
from tests.moe_kernels.test_expert_variants import clamped_act, launch, make, reference, rel_err
from tests.moe_kernels.test_expert_variants import seed  # noqa: F401 (the fixture)
from tests.moe_kernels.test_triton import DEVICE

ACT = ExpertActivation("clamped_silu", limit=0.8)


def test_torch_paths_and_dense_mlp(seed):  # noqa: F811
    x, w13, w2, _, _, weights, ids = make(seed, spread=2.0)
    ref, cut = reference(x, w13, w2, None, None, weights, ids, ACT)
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
        want = torch.stack([w2[0].double() @ clamped_act(w13[0].double() @ row, ACT)[0] for row in x.double()])
        assert rel_err(mlp(x), want) < 1e-5, f"seed={seed}"


def test_triton(seed):  # noqa: F811
    """The grouped-GEMM kernel (the gemv kernels apply the same ``gated_act``)."""
    x, w13, w2, _, _, weights, ids = make(seed, E=4, I=8, spread=2.0)  # few programs: the interpreter runs each
    ref, _ = reference(x, w13, w2, None, None, weights, ids, ACT)
    args = [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]  # compiled kernels on a GPU, interpreted without
    out = fused_moe_triton(*args, ACT, config=launch(False))
    assert rel_err(out.cpu(), ref) < 1e-5, f"seed={seed}"
