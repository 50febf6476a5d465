"""The swapped-operand MXFP4 grouped GEMMs (``GemmConfig.SWAP``, ``moe_kernels.swapped_triton``), each kernel on its
own: w13 with its activation, w2 with the routing weight, split-K off and on, against a float64 product over the
weights decoded from the e2m1/e8m0 definitions (``test_mxfp4.decode64``).

Every expert block holds 1, 3 or 17 slots (BLOCK_M 16: 15 padding rows, 13, and a second block of one), so the
slots that pad the dot's N are exercised; K is split into whole BLOCK_K steps, the last one partial or not. Scales
span e8m0's range from 0 (2**-127) up to where the outputs stay finite in float32, one level per weight row (rows of
very different magnitudes side by side), so each output is checked against its own row's size: |got - want| <=
tol * the float64 product of absolute values, plus float32's least normal (outputs of 2**-127-scaled rows underflow).
The MoE paths with biases, the clamped SwiGLU and realistic scales: ``test_mxfp4`` (PATHS "swap", "swap-split")
and, with the launch ``benchmarks.mxfp4_experts`` forces for its GPU A/B, the last test here.

Random bytes (every code), random scales and inputs; without a GPU the kernels run in Triton's CPU interpreter
(conftest.py), so shapes stay tiny. The seed is in every message (MOE_TEST_SEED=<n> replays one).
"""

import dataclasses
import os
import random

import pytest
import torch
import torch.nn.functional as F

import moe_kernels
from benchmarks.mxfp4_experts import swapped
from moe_kernels import swapped_triton, triton_backend
from moe_kernels.triton_backend import invoke_w2, invoke_w13, slot_blocks
from tests.moe_kernels.test_expert_variants import ACT, reference, rel_err
from tests.moe_kernels.test_mxfp4 import decode64, random_mxfp4
from tests.moe_kernels.test_triton import DEVICE, cfg

pytestmark = pytest.mark.skipif("triton" not in moe_kernels.available_backends(),
                                reason="triton needs CUDA or TRITON_INTERPRET=1")

E, K_TOP, H, I = 4, 2, 96, 96  # noqa: E741 (w13 BLOCK_K 64: K ends in a half step; w2 BLOCK_K 32: whole steps)
LEAST_NORMAL = 2.0**-126


@pytest.fixture
def seed() -> int:
    return int(os.environ.get("MOE_TEST_SEED") or random.SystemRandom().randrange(2**31))


def routing(gen: torch.Generator, per_expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, 2] float32, topk_ids [T, 2] int32) with T = 2 * per_expert, each of the 4 experts chosen by
    exactly ``per_expert`` tokens (even tokens experts 0 and 1, odd ones 2 and 3, tokens and pairs shuffled)."""
    t = 2 * per_expert
    pairs = torch.tensor([[0, 1], [2, 3]])[torch.arange(t) % 2]  # [T, 2]
    flip = torch.rand(t, generator=gen) < 0.5
    pairs = torch.where(flip[:, None], pairs.flip(1), pairs)[torch.randperm(t, generator=gen)]
    return torch.rand(t, 2, generator=gen), pairs.to(torch.int32)


def wide_scales(gen: torch.Generator, n: int, k: int, top: int) -> torch.Tensor:
    """uint8 scales [E, n, k/32]: row r's groups at a level drawn from 0 .. top - 3 (row 0 at 0: 2**-127) plus 0..3."""
    level = torch.randint(0, top - 3, (E, n, 1), generator=gen)
    level[:, 0] = 0
    return (level + torch.randint(0, 4, (E, n, k // 32), generator=gen)).to(torch.uint8)


class Launches:
    """A kernel's stand-in that records each launch's grid and runs the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


def _check(got: torch.Tensor, want: torch.Tensor, size: torch.Tensor, dtype: torch.dtype, seed: int) -> None:
    # float32: the sums' rounding, relative to the sum of absolute products; bfloat16 outputs: one rounding more
    # (2**-7: the interpreter's float32 -> bfloat16 cast truncates).
    tol = 1e-5 * size + LEAST_NORMAL + (want.abs() * 2.0**-7 if dtype == torch.bfloat16 else 0)
    bad = (got.double().cpu() - want).abs() > tol
    assert torch.isfinite(want).all() and not bad.any(), (
        f"seed {seed}: {int(bad.sum())} of {bad.numel()} outputs off, first at {bad.nonzero()[:1].tolist()}: "
        f"{got.flatten()[bad.flatten()][:1].tolist()} vs {want[bad][:1].tolist()}")


@pytest.mark.parametrize("per_expert", [1, 3, 17])
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # sigmoid of large negative gates
def test_w13_swapped_vs_float64(per_expert, split_k, monkeypatch, seed):
    """inter[s] = silu(gate[e] @ x[s // k]) * (up[e] @ x[s // k]); H = 96 in steps of 64 (the second half empty),
    split in two where SPLIT_K is 2. Scales up to 185: gate times up stays inside float32."""
    gen = torch.Generator().manual_seed(seed)
    weights, ids = routing(gen, per_expert)
    x = torch.randn(weights.shape[0], H, generator=gen)
    packed, _ = random_mxfp4(gen, E, 2 * I, H)
    scales = wide_scales(gen, 2 * I, H, 185)
    gemm = cfg(True, block_k=64, swap=True, split_k=split_k)
    blocks = slot_blocks(ids.to(DEVICE), E, gemm)
    out = torch.full((ids.numel(), I), float("nan"), device=DEVICE)
    monkeypatch.setattr(swapped_triton, "w13_swapped_kernel", Launches(swapped_triton.w13_swapped_kernel))
    invoke_w13(x.to(DEVICE), packed.to(DEVICE), out, blocks, K_TOP, gemm.w13, scale=scales.to(DEVICE))
    assert [grid[1] for grid in swapped_triton.w13_swapped_kernel.grids] == [split_k], "K split as asked"

    w = decode64(packed, scales)[ids.reshape(-1).long()]  # [S, 2I, H]
    xs = x.double()[torch.arange(ids.numel()) // K_TOP]  # [S, H]
    gate_up = torch.einsum("snh,sh->sn", w, xs)  # [S, 2I]
    size = torch.einsum("snh,sh->sn", w.abs(), xs.abs())
    want = F.silu(gate_up[:, :I]) * gate_up[:, I:]
    # silu's slope is at most 1.1 and |silu(g)| <= |g|: an error of e in g and f in u moves the output by at most
    # 1.1 e |u| + |g| f, within 2.1 tol |g|size |u|size.
    _check(out, want, 2.1 * size[:, :I] * size[:, I:], torch.float32, seed)


@pytest.mark.parametrize("per_expert", [1, 3, 17])
@pytest.mark.parametrize("split_k,dtype", [(1, torch.float32), (3, torch.float32), (3, torch.bfloat16)])
def test_w2_swapped_vs_float64(per_expert, split_k, dtype, monkeypatch, seed):
    """slot_out[s] = topk_weight[s] * (w2[e] @ h[s]); I = 96 in steps of 32, split in three where SPLIT_K is 3.
    Scales up to 240; bfloat16 activations and output too."""
    gen = torch.Generator().manual_seed(seed)
    weights, ids = routing(gen, per_expert)
    h = torch.randn(ids.numel(), I, generator=gen).to(dtype)  # [S, I]
    packed, _ = random_mxfp4(gen, E, H, I)
    scales = wide_scales(gen, H, I, 240)
    gemm = cfg(True, block_k=32, swap=True, split_k=split_k)
    blocks = slot_blocks(ids.to(DEVICE), E, gemm)
    out = torch.full((ids.numel(), H), float("nan"), dtype=dtype, device=DEVICE)
    slot_weights = weights.reshape(-1).contiguous()
    monkeypatch.setattr(swapped_triton, "w2_swapped_kernel", Launches(swapped_triton.w2_swapped_kernel))
    invoke_w2(h.to(DEVICE), packed.to(DEVICE), slot_weights.to(DEVICE), out, blocks, gemm.w2,
              scale=scales.to(DEVICE))
    assert [grid[1] for grid in swapped_triton.w2_swapped_kernel.grids] == [split_k], "K split as asked"

    w = decode64(packed, scales)[ids.reshape(-1).long()]  # [S, H, I]
    hs, sw = h.double(), slot_weights.double()[:, None]
    want = sw * torch.einsum("sni,si->sn", w, hs)
    _check(out, want, sw * torch.einsum("sni,si->sn", w.abs(), hs.abs()), dtype, seed)


def test_swap_is_mxfp4_only_and_written_only_where_set(seed):
    """SWAP leaves float weights on the tile kernels (same result as without it); a config file entry carries SWAP
    and SPLIT_K only where set, and SPLIT_K > 1 needs SWAP."""
    gen = torch.Generator().manual_seed(seed)
    weights, ids = routing(gen, 3)
    x = torch.randn(weights.shape[0], 64, generator=gen)
    w13 = torch.randn(E, 64, 64, generator=gen) / 8
    plain, swapped = cfg(True), cfg(True, swap=True, split_k=2)
    blocks = slot_blocks(ids.to(DEVICE), E, plain)
    outs = []
    for launch in (plain, swapped):
        outs.append(torch.empty(ids.numel(), 32, device=DEVICE))
        invoke_w13(x.to(DEVICE), w13.to(DEVICE), outs[-1], blocks, K_TOP, launch.w13)
    assert torch.equal(outs[0], outs[1]), f"seed {seed}"
    assert "SWAP" not in plain.to_dict()["w13"] and "SPLIT_K" not in plain.to_dict()["w13"]
    assert swapped.to_dict()["w13"]["SWAP"] is True and swapped.to_dict()["w13"]["SPLIT_K"] == 2
    assert triton_backend.LaunchConfig.from_dict(swapped.to_dict()) == swapped
    with pytest.raises(ValueError, match="only with SWAP"):
        dataclasses.replace(plain.w13, SPLIT_K=2)


def test_benchmark_forces_the_swap_onto_any_config(seed):
    """``benchmarks.mxfp4_experts.swapped`` (the GPU A/B's forced launch) turns a matrix-vector config into a sorted
    grouped one on the swapped kernels (64 weight rows, BLOCK_K at most 128, a warp group per 64 rows), and the MoE
    computed with it, gpt-oss's biases and clamped SwiGLU, is the float64 loop's."""
    forced = swapped(cfg(False, block_k=512, gemv=True), 2)
    assert forced.align and not forced.gemv
    assert (forced.w13.BLOCK_N, forced.w13.BLOCK_K, forced.w13.SWAP, forced.w13.SPLIT_K) == (64, 128, True, 2)
    gen = torch.Generator().manual_seed(seed)
    weights, ids = routing(gen, 3)
    x = torch.randn(weights.shape[0], 256, generator=gen)
    (q13, s13), (q2, s2) = random_mxfp4(gen, E, 64, 256), random_mxfp4(gen, E, 256, 32)  # H 256: two steps of 128
    b13, b2 = torch.randn(E, 64, generator=gen), torch.randn(E, 256, generator=gen)
    out = triton_backend.fused_moe_triton(
        *[t.to(DEVICE) for t in (x, q13, q2, weights, ids)], ACT, config=forced, w13_scale=s13.to(DEVICE),
        w2_scale=s2.to(DEVICE), w13_bias=b13.to(DEVICE), w2_bias=b2.to(DEVICE))
    ref, _ = reference(x, decode64(q13, s13), decode64(q2, s2), b13, b2, weights, ids)
    assert rel_err(out.cpu(), ref) <= 1e-5, f"seed {seed}: relative error {rel_err(out.cpu(), ref)}"
