"""The fused elementwise kernels (RMSNorm + residual, q/k norm + RoPE, routing) against torch and float64.

Without a GPU they run in Triton's CPU interpreter (TRITON_INTERPRET=1 is set
here at collection, before any kernel module is imported). Inputs are fresh
random draws each run; outputs the kernels allocate are compared whole, so an
element left unwritten fails.
"""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import LLM, KernelChoice, SamplingParams  # noqa: E402
from engine.layers.norms import RMSNorm  # noqa: E402
from engine.kernels.elementwise import rms_norm, rope_inplace  # noqa: E402
from moe_kernels.routing import route  # noqa: E402
from tests.engine.models.test_vs_transformers import hf_greedy  # noqa: E402
from tests.hf_models import make_hf_model  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = DEVICE.type == "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def rms_norm_f64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 100), (3, 48)])
def test_rms_norm_with_and_without_residual(dtype, rows, hidden):
    x = torch.randn(rows, hidden, device=DEVICE, dtype=dtype)
    residual = torch.randn(rows, hidden, device=DEVICE, dtype=dtype)
    norm = RMSNorm(hidden, eps=1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden) + 0.5)
    eager_out = norm(x)
    out = rms_norm(x, norm.weight, norm.eps)
    assert rel_err(out, rms_norm_f64(x, norm.weight, norm.eps)) < TOLERANCE[dtype]
    if dtype == torch.float32:
        assert rel_err(out, eager_out) < 1e-6

    eager_out, eager_sum = norm(x, residual)
    out, total = rms_norm(x, norm.weight, norm.eps, residual)
    # The sum is rounded to the dtype as torch's add rounds it (to nearest). Triton's CPU interpreter
    # truncates float32 -> bfloat16 instead, so there it can be one bfloat16 step off.
    if INTERPRETED and dtype == torch.bfloat16:
        assert rel_err(total, eager_sum) < 1e-2
    else:
        assert torch.equal(total, eager_sum)
    assert rel_err(out, rms_norm_f64(total, norm.weight, norm.eps)) < TOLERANCE[dtype]
    # (bfloat16 under the interpreter: its truncating casts make it a little further from the eager path.)
    assert rel_err(out, eager_out) < (TOLERANCE[dtype] if INTERPRETED else TOLERANCE[dtype] / 10)


def rope_f64(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    # x [T, n, d] float64; NeoX halves of the first r = 2 * len(inv_freq) columns, the rest passed through
    half = inv_freq.shape[0]
    angles = positions.double()[:, None] * inv_freq.double()[None, :]  # [T, r/2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,rotary_dim,num_q,num_kv,per_head_norm", [
    (16, 16, 4, 2, True), (24, 24, 3, 1, True), (32, 32, 2, 2, False),
    (32, 16, 4, 2, True), (24, 12, 2, 1, False), (40, 20, 3, 3, True),  # partial rotary (GLM-4.5: half the head)
])
def test_rope_with_per_head_norm(dtype, head_dim, rotary_dim, num_q, num_kv, per_head_norm):
    num_tokens, max_pos, base, eps = 7, 300, 10000.0, 1e-6
    width = (num_q + 2 * num_kv) * head_dim
    qkv = torch.randn(num_tokens, width, device=DEVICE, dtype=dtype)
    positions = torch.randint(0, max_pos, (num_tokens,), device=DEVICE)
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2).double() / rotary_dim)  # [r/2]
    angles = torch.arange(max_pos).double()[:, None] * inv_freq[None, :]
    cos_cache = torch.cat([angles.cos(), angles.cos()], -1).float().to(DEVICE)  # [P, r]
    sin_cache = torch.cat([angles.sin(), angles.sin()], -1).float().to(DEVICE)
    q_w = (torch.rand(head_dim) + 0.5).to(DEVICE, dtype) if per_head_norm else None
    k_w = (torch.rand(head_dim) + 0.5).to(DEVICE, dtype) if per_head_norm else None

    heads = qkv[:, : (num_q + num_kv) * head_dim].reshape(num_tokens, num_q + num_kv, head_dim).double()
    if per_head_norm:
        heads = torch.cat([rms_norm_f64(heads[:, :num_q], q_w, eps), rms_norm_f64(heads[:, num_q:], k_w, eps)], dim=1)
    expected = rope_f64(heads, positions.cpu().to(DEVICE), inv_freq.to(DEVICE))
    v_before = qkv[:, (num_q + num_kv) * head_dim:].clone()

    rope_inplace(qkv, num_q + num_kv, num_q, positions, cos_cache, sin_cache, head_dim, q_w, k_w, eps)
    got = qkv[:, : (num_q + num_kv) * head_dim].reshape(num_tokens, num_q + num_kv, head_dim)
    assert rel_err(got, expected) < TOLERANCE[dtype]
    assert torch.equal(qkv[:, (num_q + num_kv) * head_dim:], v_before), "v columns must be left alone"


@pytest.mark.parametrize("num_experts,top_k", [(8, 1), (8, 2), (60, 4), (128, 8)])
@pytest.mark.parametrize("scoring,renormalize", [("softmax", True), ("softmax", False), ("sigmoid", False)])
def test_triton_routing_matches_torch(num_experts, top_k, scoring, renormalize):
    num_tokens = 13
    # float32 logits: no ties, so both must pick the same experts in the same order.
    logits = torch.randn(num_tokens, num_experts, device=DEVICE)
    counts_torch = torch.randint(0, 5, (num_experts,), device=DEVICE)
    counts_triton = counts_torch.clone()
    ref_w, ref_ids = route(logits, top_k, renormalize, scoring, expert_counts=counts_torch)
    w, ids = route(logits, top_k, renormalize, scoring, expert_counts=counts_triton, backend="triton")
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    assert rel_err(w, ref_w) < 1e-6
    assert torch.equal(counts_triton, counts_torch)
    assert counts_torch.sum() > 0


def test_triton_routing_of_bfloat16_logits_with_ties():
    # bfloat16 logits of 128 experts tie often; which tied expert wins is unspecified in torch.topk,
    # so compare what was picked by score: the same k scores, in the same descending order.
    logits = torch.randn(64, 128, device=DEVICE, dtype=torch.bfloat16)
    ref_w, ref_ids = route(logits, 8, False)
    w, ids = route(logits, 8, False, backend="triton")
    probs = torch.softmax(logits.float(), -1)
    assert torch.equal(probs.gather(1, ids.long()), probs.gather(1, ref_ids.long()))
    assert rel_err(w, ref_w) < 1e-6
    assert all(len(set(row)) == 8 for row in ids.tolist()), "an expert was picked twice"


def test_triton_routing_of_no_tokens_and_float64_reference():
    logits = torch.randn(0, 8, device=DEVICE)
    w, ids = route(logits, 2, True, backend="triton")
    assert w.shape == ids.shape == (0, 2)
    # Against a float64 softmax + sort written out by hand.
    logits = torch.randn(9, 16, device=DEVICE)
    w, ids = route(logits, 3, True, backend="triton")
    probs = torch.softmax(logits.double(), -1)
    top = probs.sort(dim=-1, descending=True)
    assert torch.equal(ids.long(), top.indices[:, :3])
    expected = top.values[:, :3] / top.values[:, :3].sum(-1, keepdim=True)
    assert rel_err(w, expected) < 1e-6


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "glm4_moe", "minimax_m2"])
def test_engine_with_fused_elementwise_matches_transformers(family, tmp_path):
    """Greedy tokens with the fused norms/RoPE/routing equal transformers' (float32)."""
    seed = random.randrange(2**31)
    vocab = 97
    hf = make_hf_model(family, str(tmp_path), seed=seed, vocab_size=vocab, num_layers=2)
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab - 1) for _ in range(n)] for n in (1, 9, 26)]
    llm = LLM(model=str(tmp_path), dtype="float32", device=DEVICE.type, kernel_choice=KernelChoice(elementwise="triton"),
              num_kv_blocks=64, max_num_batched_tokens=20, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    got = [out.token_ids for out in llm.generate(prompts, params)]
    expected = [hf_greedy(hf.to(DEVICE), prompt, 5) for prompt in prompts]
    assert got == expected, f"seed={seed} family={family}"
    fused = [m for m in llm.engine.model.modules() if getattr(m, "fused", False) or getattr(m, "fused_rope", False)]
    assert fused, "the fused path was not switched on"
