"""The grouped-matmul torch path against a float64 loop and the per-expert loop, on fresh random shapes.

Legend: T tokens, H hidden, I expert intermediate, E experts, k top-k.
"""

import random

import pytest
import torch

import moe_kernels
from moe_kernels.grouped_backend import fused_moe_grouped, grouped_mm_supported
from moe_kernels.torch_backend import fused_moe_loop
from tests.moe_kernels.test_torch_backend import moe_float64_loop

# Relative error bound vs float64 (Frobenius norm): float32 accumulates like the reference; bf16/fp16 round
# the gathered x, the gate/up output and the activation to 8/11 bits of mantissa.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def random_case(rng: random.Random, dtype: torch.dtype, num_tokens: int, top_k: int, num_empty: int):
    """Fresh random operands; H and I are random multiples of 16 bytes, ``num_empty`` experts get no token."""
    align = 16 // torch.empty(0, dtype=dtype).element_size()
    num_experts = rng.randint(top_k + num_empty, top_k + num_empty + 12)
    hidden, inter = align * rng.randint(1, 8), align * rng.randint(1, 6)
    x = torch.randn(num_tokens, hidden).to(dtype)  # [T, H]
    w13 = (torch.randn(num_experts, 2 * inter, hidden) / hidden**0.5).to(dtype)  # [E, 2I, H]
    w2 = (torch.randn(num_experts, hidden, inter) / inter**0.5).to(dtype)  # [E, H, I]
    logits = torch.randn(num_tokens, num_experts)  # [T, E]
    empty = rng.sample(range(num_experts), num_empty)
    logits[:, empty] = float("-inf")  # never routed: their groups are empty, wherever they sit in the order
    weights, ids = moe_kernels.route(logits, top_k, renormalize=rng.random() < 0.5)  # [T, k]
    shape = dict(T=num_tokens, E=num_experts, k=top_k, H=hidden, I=inter, empty=sorted(empty), dtype=dtype)
    return (x, w13, w2, weights, ids), shape


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-300))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_tokens,top_k,num_empty", [(1, 1, 0), (1, 4, 3), (7, 1, 2), (33, 2, 1), (130, 4, 0), (64, 8, 5)])
def test_grouped_matches_float64_and_loop(dtype, num_tokens, top_k, num_empty):
    rng = random.Random()
    args, shape = random_case(rng, dtype, num_tokens, top_k, num_empty)
    x, w13, w2, weights, ids = args
    assert grouped_mm_supported(x, w13, w2), shape  # or this test would be testing the loop
    out = fused_moe_grouped(*args)
    ref = moe_float64_loop(*args)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, ref) < REL_TOL[dtype], shape
    assert rel_err(out, fused_moe_loop(*args).double()) < REL_TOL[dtype], shape
    # The public entry takes this path for these operands (bit-identical: the same computation).
    assert torch.equal(moe_kernels.fused_moe(*args, backend="torch"), out), shape
    assert torch.equal(moe_kernels.fused_moe(*args, backend="torch-loop"), fused_moe_loop(*args)), shape


def test_gelu_activation_matches_loop():
    args, shape = random_case(random.Random(), torch.float32, 40, 2, 1)
    out = fused_moe_grouped(*args, activation="gelu")
    assert rel_err(out, fused_moe_loop(*args, activation="gelu").double()) < 1e-5, shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_zero_tokens(dtype):
    args, shape = random_case(random.Random(), dtype, 0, 1, 0)
    x, w13, w2, _, _ = args
    assert grouped_mm_supported(x, w13, w2), shape
    assert fused_moe_grouped(*args).shape == (0, x.shape[1])
    assert moe_kernels.fused_moe(*args, backend="torch").shape == (0, x.shape[1])


def test_all_slots_on_one_expert():
    args, shape = random_case(random.Random(), torch.float32, 19, 1, 0)
    x, w13, w2, weights, _ = args
    ids = torch.full_like(weights, w13.shape[0] - 1, dtype=torch.int32)  # the last group holds every row
    assert rel_err(fused_moe_grouped(x, w13, w2, weights, ids), moe_float64_loop(x, w13, w2, weights, ids)) < 1e-5, shape


def _layouts(dtype: torch.dtype):
    """(name, x, w13, w2) in layouts torch._grouped_mm may or may not accept (H=I=16, E=3)."""
    x = torch.randn(5, 16).to(dtype)
    w13, w2 = torch.randn(3, 32, 16).to(dtype), torch.randn(3, 16, 16).to(dtype)
    yield "contiguous", x, w13, w2
    yield "w13 stored [E, H, 2I]", x, torch.randn(3, 16, 32).to(dtype).transpose(1, 2), w2
    yield "w2 sliced from wider rows", x, w13, torch.randn(3, 16, 20).to(dtype)[:, :, :16]
    yield "w2 rows 4 bytes off", x, w13, torch.randn(3 * 16 * 16 + 1).to(dtype)[1:].view(3, 16, 16)
    yield "w13 rows one column apart", x, torch.randn(3, 32, 17).to(dtype)[:, :, :16], w2
    yield "w13 [E, H, 2I] view, padded batch stride", x, torch.randn(3, 17, 32).to(dtype)[:, :16].transpose(1, 2), w2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_support_check_agrees_with_the_op(dtype):
    """grouped_mm_supported says yes exactly where both torch._grouped_mm calls run (probed here, in the test)."""
    for name, x, w13, w2 in _layouts(dtype):
        offs = torch.tensor([2, 2, 5], dtype=torch.int32)
        try:
            h = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs)[:, :16].contiguous()
            torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
            runs = True
        except RuntimeError:
            runs = False
        assert grouped_mm_supported(x, w13, w2) == runs, (name, dtype)


@pytest.mark.parametrize(
    "dtype,hidden,inter", [(torch.float64, 16, 8), (torch.float32, 13, 8), (torch.float32, 16, 6), (torch.bfloat16, 20, 8)]
)
def test_unsupported_operands_take_the_loop(dtype, hidden, inter):
    """float64, or H / I not a multiple of 16 bytes: "torch" falls back to the loop and is still right."""
    x = torch.randn(11, hidden).to(dtype)
    w13, w2 = torch.randn(6, 2 * inter, hidden).to(dtype) / hidden**0.5, torch.randn(6, hidden, inter).to(dtype) / inter**0.5
    weights, ids = moe_kernels.route(torch.randn(11, 6), 2, renormalize=True)
    assert not grouped_mm_supported(x, w13, w2)
    out = moe_kernels.fused_moe(x, w13, w2, weights, ids, backend="torch")
    tol = 1e-12 if dtype == torch.float64 else REL_TOL[dtype]
    assert rel_err(out, moe_float64_loop(x, w13, w2, weights, ids)) < tol


def test_mixed_dtypes_are_not_grouped():
    x = torch.randn(4, 16)
    assert not grouped_mm_supported(x, torch.randn(2, 16, 16).bfloat16(), torch.randn(2, 16, 8).bfloat16())


def test_large_cpu_calls_take_the_loop():
    """Past CPU_GROUPED_MAX_BYTES "torch" runs the loop (bit-identical to it), still right against float64."""
    from moe_kernels.torch_backend import CPU_GROUPED_MAX_BYTES

    hidden, inter, top_k = 64, 32, 4  # k > 2: the two paths add the k terms in different orders
    num_tokens = CPU_GROUPED_MAX_BYTES // (top_k * hidden * 4) + 1  # [S, H] float32 just over the limit
    x = torch.randn(num_tokens, hidden)
    w13, w2 = torch.randn(8, 2 * inter, hidden) / hidden**0.5, torch.randn(8, hidden, inter) / inter**0.5
    weights, ids = moe_kernels.route(torch.randn(num_tokens, 8), top_k, renormalize=True)
    assert grouped_mm_supported(x, w13, w2)
    assert not torch.equal(fused_moe_grouped(x, w13, w2, weights, ids), fused_moe_loop(x, w13, w2, weights, ids))
    out = moe_kernels.fused_moe(x, w13, w2, weights, ids, backend="torch")
    assert torch.equal(out, fused_moe_loop(x, w13, w2, weights, ids))
    # Tokens are independent: check a sample of rows against the (slow) float64 loop.
    assert rel_err(out[:64], moe_float64_loop(x[:64], w13, w2, weights[:64], ids[:64])) < 1e-5
