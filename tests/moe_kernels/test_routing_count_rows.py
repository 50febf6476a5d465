"""``route``'s ``count_rows``: only the first ``count_rows[0]`` tokens' picks are counted, torch and Triton (the
kernel in the CPU interpreter without a GPU), against counts tallied per token in plain Python from a float64
top-k; the ids of every row are returned as without it."""

import random

import pytest
import torch

from moe_kernels import RoutingSpec, route
from tests.moe_kernels.test_routing_kinds import DEVICE, route_float64


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("real", [0, 5, 9])
def test_only_the_real_rows_are_counted(backend, real):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    num_tokens, num_experts = 9, 8
    spec = RoutingSpec(top_k=3, scoring="softmax", renormalize=True)
    logits = torch.randn(num_tokens, num_experts, generator=gen)  # [T, E]
    start = torch.randint(0, 50, (num_experts,), generator=gen, dtype=torch.int64)  # counts from earlier steps
    counts = start.clone().to(DEVICE)
    rows = torch.tensor([real], dtype=torch.int64, device=DEVICE)  # [1]
    _, ids = route(logits.to(DEVICE), spec, expert_counts=counts, count_rows=rows, backend=backend)
    want_ids, _ = route_float64(logits, spec, None)
    assert ids.cpu().tolist() == want_ids, f"seed={seed}"
    want = start.tolist()
    for token_ids in want_ids[:real]:
        for e in token_ids:
            want[e] += 1
    assert counts.cpu().tolist() == want, f"seed={seed} backend={backend} real={real}"
