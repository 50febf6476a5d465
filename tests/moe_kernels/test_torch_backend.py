"""route() and the torch fused_moe backend against a plain float64 loop."""

import pytest
import torch

import moe_kernels


def moe_float64_loop(x, w13, w2, topk_weights, topk_ids):
    x, w13, w2, tw = x.double(), w13.double(), w2.double(), topk_weights.double()
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = w13[e] @ x[t]
            out[t] += tw[t, j] * (w2[e] @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    return out


@pytest.mark.parametrize("T,E,k,H,I", [(1, 8, 2, 16, 12), (37, 8, 1, 24, 20), (64, 16, 4, 32, 8), (5, 128, 8, 16, 8)])
def test_fused_moe_torch_matches_float64(T, E, k, H, I):
    x = torch.randn(T, H)
    w13, w2 = torch.randn(E, 2 * I, H) / H**0.5, torch.randn(E, H, I) / I**0.5
    weights, ids = moe_kernels.route(torch.randn(T, E), k, renormalize=True)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (T, k)
    assert torch.allclose(weights.sum(-1), torch.ones(T))
    out = moe_kernels.fused_moe(x, w13, w2, weights, ids, backend="torch")
    ref = moe_float64_loop(x, w13, w2, weights, ids)
    assert out.dtype == x.dtype
    assert (out.double() - ref).norm() / ref.norm() < 1e-5


def test_all_tokens_on_one_expert_and_empty_experts():
    T, E, H, I = 9, 6, 8, 4
    x = torch.randn(T, H)
    w13, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    ids = torch.full((T, 1), 3, dtype=torch.int32)
    weights = torch.rand(T, 1)
    out = moe_kernels.fused_moe(x, w13, w2, weights, ids, backend="torch")
    assert torch.allclose(out.double(), moe_float64_loop(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_route_matches_softmax_topk():
    logits = torch.randn(20, 10)
    w, ids = moe_kernels.route(logits, 3, renormalize=False)
    probs = torch.softmax(logits.double(), -1)
    ref_w, ref_ids = probs.topk(3, -1)
    assert torch.equal(ids.long(), ref_ids) and torch.allclose(w.double(), ref_w, atol=1e-6)


def test_bad_arguments_are_value_errors():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="top_k"):
        moe_kernels.route(torch.randn(4, 3), 4, renormalize=True)
    with pytest.raises(ValueError, match="w2"):
        moe_kernels.fused_moe(x, torch.randn(2, 8, 8), torch.randn(2, 8, 5), torch.rand(4, 1), torch.zeros(4, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="backend"):
        moe_kernels.fused_moe(x, torch.randn(2, 8, 8), torch.randn(2, 8, 4), torch.rand(4, 1), torch.zeros(4, 1, dtype=torch.int32), backend="cuda")
