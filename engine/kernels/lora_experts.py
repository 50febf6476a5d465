"""Launcher for the routed experts' LoRA delta kernel (``lora_experts_kernels``): the adapter pairs of a step,
grouped by (expert, adapter), in one launch. Used on CUDA by ``engine.lora.slots.ExpertSlots``."""

import functools

import torch
import triton

BLOCK_M = 16  # pairs per program: tl.dot's smallest tile; decode groups hold a few pairs
BLOCK_K = 64
BLOCK_N = 64


@functools.cache
def _kernels():
    from engine.kernels import lora_experts_kernels

    return lora_experts_kernels


def interpreted() -> bool:
    """True when the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1 at first import)."""
    return not isinstance(_kernels().expert_lora_delta_kernel, triton.runtime.JITFunction)


def expert_lora_delta(x: torch.Tensor, adapted: torch.Tensor, ends: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      out: torch.Tensor, max_rows: int) -> torch.Tensor:
    """out[p] += b[g] @ (a[g] @ x[p]) for every adapter pair p of group g; returns out.

    x [P, K] (rows with unit column stride), out [P, N] (same), ``adapted`` [P_a] int64: the pairs' rows of x
    and out, sorted by group; ``ends`` [G] int32: the end of each group's run of ``adapted``; a [G, R, K] and
    b [G, N, R] contiguous, in x's dtype; ``max_rows``: a bound on any group's size (from the host: no read-back).
    """
    num_groups, rank, in_size = a.shape
    out_size = b.shape[1]
    if adapted.shape[0] == 0 or max_rows == 0:
        return out
    assert x.stride(1) == 1 and out.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
    grid = (num_groups, triton.cdiv(max_rows, BLOCK_M))
    _kernels().expert_lora_delta_kernel[grid](
        x, adapted, ends, a, b, out, in_size, out_size, rank, x.stride(0), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_R=max(16, triton.next_power_of_2(rank)), BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST=interpreted() and x.dtype == torch.bfloat16,
    )
    return out
