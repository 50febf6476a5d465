"""Paged attention with the Triton kernels: the GPU path behind ``kernels="triton"``.

Legend: T flat tokens, D decode requests, h query heads, kvh KV heads, d head dim, S decode splits.

Same contract as ``paged_attention.paged_attention`` (q against caches that
already hold this step's K/V) but driven by ``TritonAttentionMetadata``: block
tables and lengths on the device, no masks, two launches at most (decode,
prefill) plus a small merge when decode keys are split.

Importing this module imports neither the kernels nor ``triton`` itself: once
``triton`` is imported its own jit helpers are fixed as compiled or interpreted,
and ``TRITON_INTERPRET=1`` set later (the CPU tests) would no longer work.
"""

import functools
from dataclasses import dataclass

import torch

from engine.device_batch.attention_metadata import TritonAttentionMetadata


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True, slots=True)
class AttentionLaunch:
    """Tile sizes and warps (untuned defaults; tl.dot needs every tile dim >= 16)."""

    decode_block_n: int = 64  # keys per decode iteration
    decode_warps: int = 4
    prefill_block_m: int = 64  # query tokens per prefill program
    prefill_block_n: int = 64
    prefill_warps: int = 4
    num_stages: int = 2
    max_splits: int = 16

    def __post_init__(self) -> None:
        for name in ("decode_block_n", "prefill_block_m", "prefill_block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.max_splits < 1:
            raise ValueError(f"max_splits must be >= 1, got {self.max_splits}")


DEFAULT_LAUNCH = AttentionLaunch()


@functools.cache
def _kernels():
    from engine.kernels import attention_kernels

    return attention_kernels


@functools.cache
def interpreted() -> bool:
    """Whether the kernels run in Triton's CPU interpreter (fixed at their first import)."""
    import triton

    return not isinstance(_kernels().paged_decode_kernel, triton.runtime.JITFunction)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def split_partials(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 buffers for a split decode's partial results, given its output ``out`` [D, h, d]: each split's
    unnormalised output [D, h, S, d] and its running max and sum [D, h, S, 2]. Unsplit (one split),
    the kernels never touch them: ``out`` stands in for both."""
    if num_splits <= 1:
        return out, out
    num_decodes, num_heads, width = out.shape
    part_out = torch.empty(num_decodes, num_heads, num_splits, width, dtype=torch.float32, device=out.device)
    part_ml = torch.empty(num_decodes, num_heads, num_splits, 2, dtype=torch.float32, device=out.device)
    return part_out, part_ml


def decode_splits(num_decodes: int, num_kv_heads: int, device: torch.device, launch: AttentionLaunch = DEFAULT_LAUNCH) -> int:
    """How many programs share one request's keys: enough programs to fill the GPU about twice.

    A function of the batch shape only (not of context lengths) so a CUDA graph captured for a
    batch size stays valid; splits past a short context just exit.
    """
    programs = max(num_decodes * num_kv_heads, 1)
    return max(1, min(launch.max_splits, _cdiv(2 * _num_sms(device), programs)))


def prefill_tiles(query_lens: list[int], block_m: int = DEFAULT_LAUNCH.prefill_block_m) -> tuple[list[int], list[int]]:
    """(chunk index, first query offset) of each BLOCK_M-query tile of the prefill chunks."""
    tile_req, tile_start = [], []
    for p, n in enumerate(query_lens):
        for start in range(0, n, block_m):
            tile_req.append(p)
            tile_start.append(start)
    return tile_req, tile_start


def _common_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor):
    interp = interpreted()
    if q.is_cuda == interp:
        raise RuntimeError(
            "triton attention needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set before its kernels "
            f"are first imported (q is on {q.device}, interpreter {'on' if interp else 'off'})"
        )
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    head_dim = q.shape[-1]
    return dict(
        HEAD_DIM=head_dim, KV_BLOCK=k_cache.shape[1], BLOCK_D=max(16, _next_pow2(head_dim)),
        # The interpreter multiplies bfloat16 tiles as raw integers: upcast there (exact in float32).
        UPCAST=interp and q.dtype == torch.bfloat16,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )


def _cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, ...]:
    return (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                     block_table: torch.Tensor, seq_lens: torch.Tensor, num_splits: int, scale: float,
                     sliding_window: int = 0, launch: AttentionLaunch = DEFAULT_LAUNCH,
                     sinks: torch.Tensor | None = None) -> None:
    """out [D, h, d] = attention of q [D, h, d] over each request's cached keys (written in place);
    ``sinks`` [h]: per-head sink logits or None."""
    num_decodes, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if num_decodes == 0:
        return
    common = _common_args(q, k_cache, v_cache)
    kernels = _kernels()
    split = num_splits > 1
    part_out, part_ml = split_partials(out, num_splits)
    sinks_ptr = q if sinks is None else sinks  # never read without sinks
    kernels.paged_decode_kernel[(num_decodes, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_out, part_ml, block_table, seq_lens, sinks_ptr,
        scale, sliding_window, num_splits,
        q.stride(0), q.stride(1), *_cache_strides(k_cache, v_cache), out.stride(0), out.stride(1), block_table.stride(0),
        GROUP=group, BLOCK_G=max(16, _next_pow2(group)), BLOCK_N=launch.decode_block_n,
        SPLIT=split, SLIDING=sliding_window > 0, HAS_SINKS=sinks is not None, num_warps=launch.decode_warps,
        num_stages=launch.num_stages, **common,
    )
    if split:
        kernels.paged_decode_reduce_kernel[(num_decodes, num_heads)](
            part_out, part_ml, out, sinks_ptr, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_S=max(2, _next_pow2(num_splits)), BLOCK_D=common["BLOCK_D"],
            HAS_SINKS=sinks is not None,
        )


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                      meta: TritonAttentionMetadata, scale: float, launch: AttentionLaunch = DEFAULT_LAUNCH,
                      sinks: torch.Tensor | None = None, sliding_window: int | None = None) -> None:
    """Write out's rows of every prefill chunk (q, out [T, h, d] flat; decode rows untouched).

    ``sliding_window``: this layer's own window, instead of ``meta.sliding_window``."""
    window = meta.sliding_window if sliding_window is None else sliding_window
    num_tiles = meta.prefill_tile_req.shape[0]
    if num_tiles == 0:
        return
    num_heads = q.shape[1]
    kernels = _kernels()
    kernels.paged_prefill_kernel[(num_tiles, num_heads)](
        q, k_cache, v_cache, out,
        meta.prefill_block_table, meta.prefill_seq_lens, meta.prefill_query_start, meta.prefill_query_len,
        meta.prefill_tile_req, meta.prefill_tile_start, q if sinks is None else sinks,
        scale, window,
        q.stride(0), q.stride(1), *_cache_strides(k_cache, v_cache), out.stride(0), out.stride(1),
        meta.prefill_block_table.stride(0),
        GROUP=num_heads // k_cache.shape[2], BLOCK_M=launch.prefill_block_m, BLOCK_N=launch.prefill_block_n,
        SLIDING=window > 0, HAS_SINKS=sinks is not None, num_warps=launch.prefill_warps,
        num_stages=launch.num_stages,
        **_common_args(q, k_cache, v_cache),
    )


def triton_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: TritonAttentionMetadata, scale: float, out: torch.Tensor | None = None,
                           launch: AttentionLaunch = DEFAULT_LAUNCH, sinks: torch.Tensor | None = None,
                           sliding_window: int | None = None) -> torch.Tensor:
    """q [T, h, d] against the paged caches [N_blocks, bs, kvh, d] -> [T, h, d]; every row written.

    ``meta.prefill_tile_*`` must come from ``prefill_tiles`` with ``launch.prefill_block_m``. ``sinks`` [h]:
    per-head sink logits (gpt-oss) or None; ``sliding_window``: the layer's own window (0: none), or None for
    ``meta.sliding_window``.
    """
    if out is None:
        out = torch.empty_like(q)
    window = meta.sliding_window if sliding_window is None else sliding_window
    d = meta.num_decodes
    decode_attention(q[:d], k_cache, v_cache, out[:d], meta.decode_block_table, meta.decode_seq_lens,
                     meta.decode_splits, scale, window, launch, sinks)
    if meta.num_prefills:
        prefill_attention(q, k_cache, v_cache, out, meta, scale, launch, sinks, window)
    return out
