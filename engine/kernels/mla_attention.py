"""MLA (multi-head latent attention) decode with the Triton kernels, over a latent paged cache.

Legend: D decode requests, h query heads (this rank's), R latent rank (``kv_lora_rank``),
P rotary width (``qk_rope_head_dim``), S decode splits, bs tokens per block, W block-table width.

The absorbed form of DeepSeek-V2/V3 attention at decode: the query is already
multiplied into the latent space (q_nope @ W_UK, then the rotated q_pe), so each
head's scores are ``scale * q . row`` over the request's latent rows (the whole
R + P row is the key) and its output is ``softmax @ row[:R]`` (the first R values
are the value), still in the latent space (the caller applies W_UV). The cache is
read once for K and V and once for all heads.

Importing this module imports neither the kernels nor ``triton`` itself (see
``engine.kernels.attention``): TRITON_INTERPRET=1 set later still works.

Launch choices for an H100 (``MlaDecodeLaunch``). Compiled for sm_90 they hold
(``python -m benchmarks.mla_decode --resources``, no GPU needed) without spilling;
their speed is not yet measured on a GPU (``benchmarks/mla_decode.py --sweep`` times
them beside the alternatives):

- Heads per program (BLOCK_H): 16 up to 16 local heads (V3 at TP8, V2-Lite), else 32,
  with 4 warps per 16 heads. The [BLOCK_H, R] float32 accumulator and the query
  tile live in registers: 254 a thread for 16 heads on 4 warps, 206 for 32 heads on
  8 warps; 64 heads spill even on 16 warps. Programs of the same request and split
  are launched together (head tiles are the fastest grid axis), so the 4 head tiles
  of 128 heads can share each row through L2 rather than read it 4 times from HBM.
- Latent rows per iteration (BLOCK_N) 32 and 2 pipeline stages: a 32 x 576 bfloat16
  tile is 36 KiB; 64 rows at 16 heads need 8 warps to stay under 255 registers.
- Splits (flash decoding): enough programs to fill the GPU about twice
  (``2 * SMs / (D * head tiles)``), at most ``max_splits`` (64: a 16k context at
  batch 1 still gets 256 rows a split); with the context length known on the host
  (``max_seq_len``) also few enough that each split reads at least twice the bytes
  its partial result costs to write and merge (one [h, R] float32 slab per split:
  at h = 128 a split needs ~900 rows to be worth it, at h = 16 ~115). Without it
  the count depends on the batch shape only, so a CUDA graph captured for a batch
  size stays valid. The merge walks the splits one at a time, so their number
  costs no registers.
"""

import functools
from dataclasses import dataclass

import torch

from engine.kernels.attention import _cdiv, _next_pow2, _num_sms, interpreted, split_partials
from engine.device_batch.attention_metadata import TritonAttentionMetadata


@dataclass(frozen=True, slots=True)
class MlaDecodeLaunch:
    """Tile sizes, warps and split limits of the MLA decode kernel (tl.dot needs every tile dim >= 16)."""

    block_n: int = 32  # latent rows per iteration
    max_block_h: int = 32  # heads per program: the local head count rounded up to a power of two, 16 at least
    warps_per_16_heads: int = 4
    num_stages: int = 2
    max_splits: int = 64
    # A split must read at least this many times the bytes its partial result writes and the merge reads back.
    min_split_read_ratio: int = 2

    def __post_init__(self) -> None:
        for name in ("block_n", "max_block_h"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        for name in ("warps_per_16_heads", "num_stages", "max_splits", "min_split_read_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def block_h(self, num_heads: int) -> int:
        return min(self.max_block_h, max(16, _next_pow2(num_heads)))

    def num_warps(self, num_heads: int) -> int:
        return self.warps_per_16_heads * self.block_h(num_heads) // 16


DEFAULT_MLA_LAUNCH = MlaDecodeLaunch()


@functools.cache
def _kernels():
    from engine.kernels import mla_attention_kernels

    return mla_attention_kernels


def mla_decode_splits(num_decodes: int, num_heads: int, kv_lora_rank: int, row_bytes: int, num_sms: int,
                      launch: MlaDecodeLaunch = DEFAULT_MLA_LAUNCH, max_seq_len: int | None = None) -> int:
    """How many programs share one request's keys (see the module docstring for the rule).

    row_bytes: one latent row, (R + P) * element size; num_sms: the device's multiprocessors.
    max_seq_len: the longest context in the batch when the host knows it (eager calls); None keeps
    the count a function of the batch shape.
    """
    programs = max(num_decodes, 1) * _cdiv(num_heads, launch.block_h(num_heads))
    splits = max(1, min(launch.max_splits, _cdiv(2 * num_sms, programs)))
    if max_seq_len is not None:
        # One split's partial: [h, R] float32 plus (max, sum), written once and read once by the merge.
        partial_bytes = 2 * num_heads * (kv_lora_rank + 2) * 4
        min_keys = max(launch.block_n, _cdiv(launch.min_split_read_ratio * partial_bytes, row_bytes))
        splits = max(1, min(splits, _cdiv(max_seq_len, min_keys)))
    return splits


def decode_constants(num_heads: int, kv_lora_rank: int, rope: int, block_size: int, dtype: torch.dtype, split: bool,
                     launch: MlaDecodeLaunch = DEFAULT_MLA_LAUNCH, interpreter: bool = False) -> dict:
    """The decode kernel's compile-time arguments for one shape (what a compiled variant is keyed on)."""
    return dict(
        NUM_HEADS=num_heads, RANK=kv_lora_rank, ROPE=rope, KV_BLOCK=block_size, BLOCK_H=launch.block_h(num_heads),
        BLOCK_R=max(16, _next_pow2(kv_lora_rank)), BLOCK_P=max(16, _next_pow2(rope)), BLOCK_N=launch.block_n,
        SPLIT=split,
        # The interpreter multiplies bfloat16 tiles as raw integers: upcast there (exact in float32).
        UPCAST=interpreter and dtype == torch.bfloat16,
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
    )


def _check(q: torch.Tensor, latent_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
           kv_lora_rank: int) -> None:
    if q.dim() != 3 or latent_cache.dim() != 3:
        raise ValueError(f"q must be [D, h, R + P] and latent_cache [blocks, block_size, R + P]; got "
                         f"{tuple(q.shape)} and {tuple(latent_cache.shape)}")
    if q.shape[-1] != latent_cache.shape[-1] or not 0 < kv_lora_rank < q.shape[-1]:
        raise ValueError(f"q's last dim ({q.shape[-1]}) must equal the cache row width ({latent_cache.shape[-1]}), "
                         f"and kv_lora_rank ({kv_lora_rank}) must lie strictly inside it")
    if q.dtype != latent_cache.dtype:
        raise ValueError(f"q ({q.dtype}) and latent_cache ({latent_cache.dtype}) must share a dtype")
    if block_table.shape[0] != q.shape[0] or seq_lens.shape != (q.shape[0],):
        raise ValueError(f"block_table {tuple(block_table.shape)} and seq_lens {tuple(seq_lens.shape)} "
                         f"must have one row per decode request ({q.shape[0]})")
    if q.stride(-1) != 1 or latent_cache.stride(-1) != 1 or block_table.stride(-1) != 1:
        raise ValueError("q, latent_cache and block_table must be contiguous in their last dim")
    if q.is_cuda == interpreted():
        raise RuntimeError(
            "triton MLA attention needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set before its kernels "
            f"are first imported (q is on {q.device}, interpreter {'on' if interpreted() else 'off'})")


def mla_decode_triton(q: torch.Tensor, latent_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      scale: float, kv_lora_rank: int, launch: MlaDecodeLaunch = DEFAULT_MLA_LAUNCH, *,
                      num_splits: int | None = None, max_seq_len: int | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed MLA decode: out [D, h, R] = softmax(scale * q . rows) @ rows[:, :R] per request and head.

    q [D, h, R + P] (q_nope @ W_UK, then the rotated q_pe); latent_cache [N_blocks + 1, bs, R + P]
    (c_kv after its norm, then the rotated k_pe), q's dtype; block_table [D, W] and seq_lens [D]
    int64 on q's device, seq_lens counting the new token. A padding row (seq_len 0) gets zeros;
    no table entry past a request's ``cdiv(seq_len, bs)`` blocks is read. out in q's dtype
    (written in place when given, [D, h, R]). num_splits: None picks ``mla_decode_splits``
    (with ``max_seq_len`` when given).
    """
    _check(q, latent_cache, block_table, seq_lens, kv_lora_rank)
    num_decodes, num_heads, width = q.shape
    rope = width - kv_lora_rank
    if out is None:
        out = torch.empty(num_decodes, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    elif out.shape != (num_decodes, num_heads, kv_lora_rank) or out.stride(-1) != 1 or out.device != q.device:
        raise ValueError(f"out must be [D, h, kv_lora_rank] = {(num_decodes, num_heads, kv_lora_rank)} on {q.device}, "
                         f"contiguous in its last dim; got {tuple(out.shape)} on {out.device}")
    if num_decodes == 0:
        return out
    if num_splits is None:
        num_splits = mla_decode_splits(num_decodes, num_heads, kv_lora_rank, width * q.element_size(),
                                       _num_sms(q.device), launch, max_seq_len)
    split = num_splits > 1
    part_out, part_ml = split_partials(out, num_splits)
    kernels = _kernels()
    consts = decode_constants(num_heads, kv_lora_rank, rope, latent_cache.shape[1], q.dtype, split, launch, interpreted())
    kernels.mla_decode_kernel[(_cdiv(num_heads, consts["BLOCK_H"]), num_splits, num_decodes)](
        q, latent_cache, out, part_out, part_ml, block_table, seq_lens, scale, num_splits,
        q.stride(0), q.stride(1), latent_cache.stride(0), latent_cache.stride(1), out.stride(0), out.stride(1),
        block_table.stride(0), **consts, num_warps=launch.num_warps(num_heads), num_stages=launch.num_stages,
    )
    if split:
        kernels.mla_merge_kernel[(num_heads, num_decodes)](
            part_out, part_ml, out, seq_lens, num_splits, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, RANK=kv_lora_rank, BLOCK_R=consts["BLOCK_R"], BLOCK_N=launch.block_n,
            num_warps=4,
        )
    return out


def mla_decode_from_metadata(q: torch.Tensor, latent_cache: torch.Tensor, meta: TritonAttentionMetadata, scale: float,
                             kv_lora_rank: int, launch: MlaDecodeLaunch = DEFAULT_MLA_LAUNCH,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """``mla_decode_triton`` over a step's decodes: q [T >= D, h, R + P] flat (decodes first) -> [D, h, R].

    Rows past ``meta.num_decodes`` (prefill chunks) are not read. The split count is the kernel's own
    (``mla_decode_splits`` by batch shape, CUDA-graph safe), not ``meta.decode_splits``, which is sized
    for the K/V kernel's programs per request.
    """
    d = meta.num_decodes
    return mla_decode_triton(q[:d], latent_cache, meta.decode_block_table, meta.decode_seq_lens, scale, kv_lora_rank,
                             launch, out=out)
