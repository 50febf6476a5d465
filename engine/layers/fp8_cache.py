"""The FP8 cache rows of sparse MLA attention (``--kv-cache-dtype fp8``), in DeepSeek-V3.2's published layout.

Per token and layer, two byte rows (uint8 cache tensors):

- the latent row, ``r + 4 * ceil(r / 128) + 2 * p`` bytes: the ``r`` latent values in float8_e4m3fn, one float32
  scale per tile of 128 of them, then the ``p`` rotary values in bfloat16 (r = 512, p = 64: 512 + 16 + 128 = 656);
- the indexer key, ``d + 4 * ceil(d / 128)`` bytes: ``d`` float8_e4m3fn values and their float32 tile scales
  (d = 128: 128 + 4 = 132).

A tile's scale is its absolute maximum over 448 (e4m3's largest finite value), so the tile's largest value maps to
448; an all-zero tile takes the smallest scale (``MIN_AMAX / 448``: every value quantizes to 0, and the division
stays finite). Values are divided by their scale in float32 and rounded to nearest (ties to even) by
``Tensor.to(float8_e4m3fn)``; reading multiplies back in float32. The tail of a width that is not a multiple of 128
is a tile of its own (tiny test shapes).
"""

import math

import torch

TILE = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
MIN_AMAX = 1e-4  # an all-zero tile's stand-in maximum (as DeepSeek's reference activation quantizer clamps it)


def tiles(width: int) -> int:
    return math.ceil(width / TILE)


def latent_row_bytes(latent_dim: int, rope_dim: int) -> int:
    """Bytes of one FP8 latent row: the fp8 latent, its scales, the bf16 rotary part."""
    return latent_dim + 4 * tiles(latent_dim) + 2 * rope_dim


def key_row_bytes(width: int) -> int:
    """Bytes of one FP8 indexer key: the fp8 values and their scales."""
    return width + 4 * tiles(width)


def quantize_tiles(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, w] -> (values [T, w] float8_e4m3fn, scales [T, ceil(w / 128)] float32): one absmax scale per tile."""
    n, width = x.shape
    pad = tiles(width) * TILE - width
    xt = torch.nn.functional.pad(x.float(), (0, pad)).view(n, -1, TILE)  # [T, tiles, 128]
    scales = xt.abs().amax(dim=-1).clamp(min=MIN_AMAX) / FP8_MAX  # [T, tiles]
    values = (xt / scales[..., None]).to(FP8).view(n, -1)[:, :width]
    return values, scales


def dequantize_tiles(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """values [..., w] float8_e4m3fn, scales [..., ceil(w / 128)] float32 -> [..., w] float32."""
    width = values.shape[-1]
    per_value = scales.repeat_interleave(TILE, dim=-1)[..., :width]  # [..., w]
    return values.float() * per_value


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """t [T, k] -> its bytes [T, k * itemsize] uint8."""
    return t.contiguous().view(torch.uint8)


def _as(rows: torch.Tensor, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes [start, end) of rows [..., B] uint8 read as ``dtype`` [..., (end - start) / itemsize]."""
    return rows[..., start:end].contiguous().view(dtype)


def pack_latent_rows(latent: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """latent [T, r], k_pe [T, p] -> rows [T, latent_row_bytes(r, p)] uint8."""
    values, scales = quantize_tiles(latent)
    return torch.cat([_bytes(values), _bytes(scales), _bytes(k_pe.to(torch.bfloat16))], dim=-1)


def unpack_latent_rows(rows: torch.Tensor, latent_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """rows [..., latent_row_bytes(r, p)] uint8 -> [..., r + p] in ``dtype`` (latent, then rotary part); an all-zero
    byte row reads as zeros."""
    scale_end = latent_dim + 4 * tiles(latent_dim)
    latent = dequantize_tiles(_as(rows, 0, latent_dim, FP8), _as(rows, latent_dim, scale_end, torch.float32))
    rope = _as(rows, scale_end, rows.shape[-1], torch.bfloat16)
    return torch.cat([latent.to(dtype), rope.to(dtype)], dim=-1)


def pack_key_rows(keys: torch.Tensor) -> torch.Tensor:
    """keys [T, d] -> rows [T, key_row_bytes(d)] uint8."""
    values, scales = quantize_tiles(keys)
    return torch.cat([_bytes(values), _bytes(scales)], dim=-1)


def unpack_key_rows(rows: torch.Tensor, width: int) -> torch.Tensor:
    """rows [..., key_row_bytes(d)] uint8 -> keys [..., d] float32 (the indexer scores in float32)."""
    return dequantize_tiles(_as(rows, 0, width, FP8), _as(rows, width, rows.shape[-1], torch.float32))
