"""The routed experts' LoRA delta kernel against a float64 loop over pairs.

Without a GPU the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1 is set here at collection, before
the kernel module is imported). Fresh random inputs each run: group sizes (empty groups included), ranks, sizes
that are not multiples of the tiles, and rows of x/out that belong to no adapter pair (left as they were).
"""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.kernels.lora_experts import BLOCK_M, expert_lora_delta  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_lora_delta_matches_float64(dtype):
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_groups, rank = rng.randint(3, 7), rng.choice([8, 16])
    in_size, out_size = rng.choice([40, 72, 96]), rng.choice([24, 80, 130])
    sizes = [rng.choice([0, 1, 3, BLOCK_M + 2]) for _ in range(num_groups)]
    sizes[rng.randrange(num_groups)] = BLOCK_M + 5  # a group over two row blocks
    num_pairs = sum(sizes) + rng.randint(1, 9)  # some rows are base-model pairs: no delta
    adapted = torch.randperm(num_pairs)[:sum(sizes)].to(DEVICE)  # [P_a] rows of x/out, group by group
    ends = torch.tensor(sizes).cumsum(0).to(torch.int32).to(DEVICE)  # [G]
    x_wide = torch.randn(num_pairs, in_size + 5, dtype=dtype, device=DEVICE)
    x = x_wide[:, :in_size]  # rows with a stride wider than the row, as the activation's view has
    a = torch.randn(num_groups, rank, in_size, dtype=dtype, device=DEVICE) / in_size**0.5
    b = torch.randn(num_groups, out_size, rank, dtype=dtype, device=DEVICE) / rank**0.5
    out = torch.randn(num_pairs, out_size, dtype=dtype, device=DEVICE)
    before = out.clone()

    expert_lora_delta(x, adapted, ends, a, b, out, max(sizes))

    want = before.double()
    start = 0
    for g, size in enumerate(sizes):
        for p in adapted[start:start + size].tolist():
            want[p] += b[g].double() @ (a[g].double() @ x[p].double())
        start += size
    err = ((out.double() - want).norm() / want.norm()).item()
    assert err < TOLERANCE[dtype], f"seed {seed}: relative error {err}"
    untouched = torch.ones(num_pairs, dtype=torch.bool)
    untouched[adapted.cpu()] = False
    assert torch.equal(out[untouched.to(DEVICE)], before[untouched.to(DEVICE)]), f"seed {seed}"
    assert not torch.allclose(out.double(), before.double(), atol=1e-3)  # the deltas were added
