"""Launchers for the fused elementwise kernels (RMSNorm with residual add; q/k norm + RoPE).

Legend: T tokens, H hidden, h query heads, kvh KV heads, d head dim.

Numerics follow the torch layers: reductions in float32, and a rounding to
the model dtype wherever the torch path rounds (the residual sum, the
normalized row before its weight). RoPE multiplies in float32 rather than in
the dtype, so in bfloat16 it differs from the torch path by rounding only;
in float32 the two agree to float32 precision.
"""

import functools

import torch
import triton


@functools.cache
def _kernels():
    from engine.kernels import elementwise_kernels

    return elementwise_kernels


def _check_device(x: torch.Tensor) -> None:
    interpreted = not isinstance(_kernels().rms_norm_kernel, triton.runtime.JITFunction)
    if x.is_cuda == interpreted:
        raise RuntimeError("triton elementwise kernels need CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set "
                           f"before their module is first imported (x on {x.device})")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [T, H] (rows contiguous) scaled by weight [H].

    With ``residual`` [T, H]: returns (norm(x + residual), x + residual), the sum
    rounded to x's dtype first, as ``x + residual`` in torch would be.
    """
    _check_device(x)
    num_rows, hidden = x.shape
    assert x.stride(1) == 1 and weight.is_contiguous()
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    if num_rows:
        block = triton.next_power_of_2(hidden)
        _kernels().rms_norm_kernel[(num_rows,)](
            x, residual if residual is not None else x, weight, out, res_out,
            hidden, eps, x.stride(0), (residual if residual is not None else x).stride(0), out.stride(0), res_out.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        )
    return (out, res_out) if residual is not None else out


def rope_inplace(x: torch.Tensor, num_heads: int, num_norm_heads_first: int, positions: torch.Tensor,
                 cos_cache: torch.Tensor, sin_cache: torch.Tensor, head_dim: int,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 0.0) -> None:
    """Rotate ``num_heads`` heads of x [T, >= num_heads * d] (row-strided, columns contiguous) in place.

    With norm weights, each head is first RMS-normalized (per head, as Qwen3's
    q_norm/k_norm): heads below ``num_norm_heads_first`` use ``q_weight``, the
    rest ``k_weight``. cos/sin: [P, r] float32 tables holding cat(freqs, freqs);
    r < d is partial rotary: only each head's first r columns are rotated.
    """
    _check_device(x)
    num_tokens = x.shape[0]
    assert x.stride(-1) == 1 and cos_cache.is_contiguous() and sin_cache.is_contiguous()
    rotated = cos_cache.shape[1]
    assert rotated % 2 == 0 and rotated <= head_dim, (rotated, head_dim)
    if num_tokens == 0:
        return
    norm = q_weight is not None
    half, rest = rotated // 2, head_dim - rotated
    _kernels().qk_norm_rope_kernel[(num_tokens, num_heads)](
        x, positions, cos_cache, sin_cache, q_weight if norm else cos_cache, k_weight if norm else cos_cache,
        num_norm_heads_first, eps, x.stride(0), cos_cache.stride(0),
        HEAD_DIM=head_dim, HALF=half, BLOCK_HALF=triton.next_power_of_2(half), PASS=rest,
        BLOCK_PASS=triton.next_power_of_2(max(rest, 1)), NORM=norm, num_warps=1,
    )
