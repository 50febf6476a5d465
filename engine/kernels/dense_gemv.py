"""Launcher for the dense matrix-vector kernels: y[M, N] = x[M, K] @ W[N, K]^T (+ b) at M <= 8.

Legend: M rows, N output features, K input features, S K-splits.

Which launch (if any) a projection uses is measured at engine start
(``engine.transforms.gemv_select``); this module only runs one.
"""

import functools
from dataclasses import dataclass

import torch
import triton

MAX_GEMV_ROWS = 8  # beyond a handful of rows cuBLAS's tiled GEMM re-reads nothing and wins
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _kernels():
    from engine.kernels import dense_gemv_kernels

    return dense_gemv_kernels


def interpreted() -> bool:
    """True when the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 at first import)."""
    return not isinstance(_kernels().dense_gemv_kernel, triton.runtime.JITFunction)


@dataclass(frozen=True, slots=True)
class GemvConfig:
    """One launch: tile sizes, warps, pipeline depth, FMA or tensor-core path, and K-splits.

    ``block_m`` is the row tile: every call with up to ``block_m`` rows uses the
    same compiled kernel (rows past the call's M are masked), so a batch that
    grows from 2 to 3 rows compiles nothing new. The dot path needs
    ``block_m``, ``block_n`` and ``block_k`` >= 16.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    dot: bool = False
    split_k: int = 1

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        if self.dot and min(self.block_m, self.block_n, self.block_k) < 16:
            raise ValueError(f"the dot path needs tiles >= 16, got {self}")
        if self.split_k < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"split_k, num_warps and num_stages must be >= 1, got {self}")

    def short(self) -> str:
        path = "dot" if self.dot else "fma"
        return (f"{path} m{self.block_m} n{self.block_n} k{self.block_k} w{self.num_warps} s{self.num_stages} "
                f"split{self.split_k}")


def split_tiles(k_size: int, cfg: GemvConfig) -> int:
    """BLOCK_K tiles of K per split: whole tiles, so only the last split can end inside a tile."""
    return triton.cdiv(triton.cdiv(k_size, cfg.block_k), cfg.split_k)


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: GemvConfig,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T + bias [N] -> [M, N] in x's dtype, accumulated in float32.

    M must be <= ``cfg.block_m``; x and weight contiguous along K; ``out``
    (optional, [M, N] with unit column stride) is written whole. No host sync;
    with ``cfg.split_k`` > 1 a float32 [S, M, N] buffer is allocated per call
    (the caching allocator's, so CUDA graphs capture it like any temporary).
    """
    num_rows, k_size = x.shape
    n_size = weight.shape[0]
    if x.is_cuda == interpreted():
        raise RuntimeError("the dense gemv kernels need CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set "
                           f"before their module is first imported (x on {x.device})")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"x, weight and bias must share one of {_DTYPES}, got {x.dtype}, {weight.dtype}")
    assert weight.shape[1] == k_size and x.stride(1) == 1 and weight.stride(1) == 1, (x.shape, weight.shape)
    assert num_rows <= cfg.block_m, f"{num_rows} rows in a launch for at most {cfg.block_m}"
    if out is None:
        out = torch.empty(num_rows, n_size, dtype=x.dtype, device=x.device)  # [M, N]
    assert out.shape == (num_rows, n_size) and out.stride(1) == 1
    if num_rows == 0:
        return out
    tiles = split_tiles(k_size, cfg)
    splits = triton.cdiv(k_size, tiles * cfg.block_k)  # at most cfg.split_k, and no split left empty
    part = out if splits == 1 else torch.empty(splits, num_rows, n_size, dtype=torch.float32, device=x.device)
    kernels = _kernels()
    kernels.dense_gemv_kernel[(triton.cdiv(n_size, cfg.block_n), splits)](
        x, weight, bias if bias is not None else x, out, part,
        num_rows, n_size, k_size, splits, tiles,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, USE_DOT=cfg.dot, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST=cfg.dot and interpreted() and x.dtype == torch.bfloat16, EVEN_K=k_size % cfg.block_k == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        block = min(1024, triton.next_power_of_2(n_size))
        kernels.split_k_sum_kernel[(num_rows, triton.cdiv(n_size, block))](
            part, bias if bias is not None else part, out, num_rows, n_size, splits, out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_N=block, num_warps=4,
        )
    return out
