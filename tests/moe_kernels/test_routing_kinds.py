"""Every routing kind (softmax / sigmoid, correction bias, grouped top-k, renormalisation, scaling), torch and
Triton, against a float64 loop written out per token; random logits and random correction biases.

The Triton kernel runs in the CPU interpreter without a GPU (tests/conftest.py sets TRITON_INTERPRET=1).
"""

import math
import random

import pytest
import torch

from moe_kernels import RoutingSpec, route

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def route_float64(logits: torch.Tensor, spec: RoutingSpec, bias: torch.Tensor | None) -> tuple[list, list]:
    """One token at a time, in float64 and plain Python: the ids (in choice order) and weights."""
    all_ids, all_weights = [], []
    num_experts = logits.shape[1]
    size = num_experts // spec.n_group
    for row in logits.double().tolist():
        if spec.scoring == "softmax":
            top = max(row)
            exps = [math.exp(v - top) for v in row]
            scores = [v / sum(exps) for v in exps]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in row]
        choice = [s + (float(bias[e]) if bias is not None else 0.0) for e, s in enumerate(scores)]
        allowed = set(range(num_experts))
        if spec.n_group > 1:
            group_scores = []
            for g in range(spec.n_group):
                members = sorted((choice[e] for e in range(g * size, (g + 1) * size)), reverse=True)
                group_scores.append(members[0] + members[1] if spec.group_scoring == "top2_sum" else members[0])
            best = sorted(range(spec.n_group), key=lambda g: -group_scores[g])[:spec.topk_group]
            allowed = {e for g in best for e in range(g * size, (g + 1) * size)}
        ids = sorted(allowed, key=lambda e: -choice[e])[:spec.top_k]
        weights = [scores[e] for e in ids]
        if spec.renormalize:
            weights = [w / sum(weights) for w in weights]
        all_ids.append(ids)
        all_weights.append([w * spec.scaling_factor for w in weights])
    return all_ids, all_weights


SPECS = [
    # GLM-4.5-Air / DeepSeek-V3 style: sigmoid, bias, grouped by top-2 sums, renormalised, scaled.
    (16, RoutingSpec(top_k=4, scoring="sigmoid", renormalize=True, n_group=4, topk_group=2, scaling_factor=2.5), True),
    # MiniMax-M2 style: sigmoid + bias, one group, renormalised.
    (12, RoutingSpec(top_k=3, scoring="sigmoid", renormalize=True), True),
    # dots.llm1 style: sigmoid + bias, not renormalised, scaled; uneven group size (3 per group, 4 groups).
    (12, RoutingSpec(top_k=2, scoring="sigmoid", n_group=4, topk_group=1, scaling_factor=0.7), True),
    # DeepSeek-V2 group_limited_greedy: softmax, group score = max, no renormalisation, scaled; 5 per group.
    (20, RoutingSpec(top_k=3, scoring="softmax", n_group=4, topk_group=2, group_scoring="max", scaling_factor=16.0), False),
    # Plain kinds through the spec.
    (8, RoutingSpec(top_k=2, renormalize=True), False),
    (10, RoutingSpec(top_k=3, scoring="sigmoid"), False),
    # Softmax with a bias, and every group kept (n_group == topk_group: no restriction).
    (8, RoutingSpec(top_k=2, n_group=2, topk_group=2), True),
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("num_experts,spec,with_bias", SPECS, ids=[f"spec{i}" for i in range(len(SPECS))])
def test_routing_kinds_match_float64_loop(backend, num_experts, spec, with_bias):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    num_tokens = 11
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(DEVICE)
    # Biases of the size of the score differences, so the correction really changes which experts win.
    bias = (torch.randn(num_experts, generator=gen) * 0.3).to(DEVICE) if with_bias else None
    counts = torch.randint(0, 5, (num_experts,), generator=gen).to(DEVICE)
    counts_before = counts.clone()
    weights, ids = route(logits, spec, correction_bias=bias, expert_counts=counts, backend=backend)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (num_tokens, spec.top_k)
    ref_ids, ref_weights = route_float64(logits.cpu(), spec, bias.cpu() if bias is not None else None)
    assert ids.tolist() == ref_ids, f"seed={seed}"
    assert torch.allclose(weights.double().cpu(), torch.tensor(ref_weights, dtype=torch.float64), rtol=1e-5,
                          atol=1e-7), f"seed={seed}"
    expected_counts = counts_before.cpu() + torch.bincount(torch.tensor(ref_ids).flatten(), minlength=num_experts)
    assert torch.equal(counts.cpu(), expected_counts)


def test_correction_bias_changes_the_choice_but_not_the_weights():
    # Expert 0 has the lowest score but a bias that makes it win: it is chosen, weighted by its own score.
    logits = torch.tensor([[-3.0, 1.0, 2.0, 0.5]], device=DEVICE)
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0], device=DEVICE)
    for backend in ("torch", "triton"):
        weights, ids = route(logits, RoutingSpec(top_k=2, scoring="sigmoid"), correction_bias=bias, backend=backend)
        assert ids.tolist() == [[0, 2]]
        assert torch.allclose(weights.cpu(), torch.sigmoid(torch.tensor([[-3.0, 2.0]])))


def test_bad_specs_are_value_errors():
    logits = torch.randn(3, 12)
    with pytest.raises(ValueError, match="n_group"):
        route(logits, RoutingSpec(top_k=2, n_group=5, topk_group=1))
    with pytest.raises(ValueError, match="topk_group"):
        RoutingSpec(top_k=2, n_group=2, topk_group=3)
    with pytest.raises(ValueError, match="top_k"):
        route(logits, RoutingSpec(top_k=4, n_group=4, topk_group=1))  # 3 experts per group, 1 group kept
    with pytest.raises(ValueError, match="correction_bias"):
        route(logits, RoutingSpec(top_k=2), correction_bias=torch.zeros(11))
    with pytest.raises(ValueError, match="group_scoring"):
        RoutingSpec(top_k=2, group_scoring="sum")


def test_no_tokens():
    spec = RoutingSpec(top_k=2, scoring="sigmoid", n_group=2, topk_group=1)
    for backend in ("torch", "triton"):
        weights, ids = route(torch.randn(0, 8, device=DEVICE), spec, correction_bias=torch.randn(8, device=DEVICE),
                             backend=backend)
        assert weights.shape == ids.shape == (0, 2)
