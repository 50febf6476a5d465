"""MXFP4 expert weights: 4-bit e2m1 values with one power-of-two (e8m0) scale per 32 values along K.

Legend: N output channels (rows), K reduction dim (columns) of one weight [.., N, K]; K must be a multiple of 32.

A weight is stored as two uint8 tensors, the bytes of gpt-oss's published checkpoints (``*_blocks`` [.., N, K/32, 16]
and ``*_scales`` [.., N, K/32]) with the block dims merged, which is a view, not a copy:

- ``packed`` [.., N, K/2]: byte j of a row holds value 2j in its low nibble and value 2j+1 in its high nibble;
  each nibble is an e2m1 code: sign bit 3, exponent bits 2-1, mantissa bit 0 (``E2M1_VALUES``).
- ``scales`` [.., N, K/32]: e8m0 exponents biased by 127: W[.., n, k] = e2m1(code) * 2**(scales[.., n, k // 32] - 127).

Dequantized values are exact in float32 and bfloat16 (a 2-bit significand times a power of two).
Plain torch; ``moe_kernels.mxfp4_triton`` reads the same layout inside the Triton kernels.
"""

import torch

# e2m1 by 4-bit code: sign bit 3, then exponent (2 bits) and mantissa (1 bit).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0
SCALE_BIAS = 127
VALUES_PER_SCALE = 32


def packed_shape(weight_shape: tuple[int, ...]) -> tuple[int, ...]:
    """[.., N, K] -> the packed bytes' shape [.., N, K/2]."""
    *lead, n, k = weight_shape
    _check_k(k)
    return (*lead, n, k // 2)


def scale_shape(weight_shape: tuple[int, ...]) -> tuple[int, ...]:
    """[.., N, K] -> the scales' shape [.., N, K/32]."""
    *lead, n, k = weight_shape
    _check_k(k)
    return (*lead, n, k // VALUES_PER_SCALE)


def _check_k(k: int) -> None:
    if k % VALUES_PER_SCALE:
        raise ValueError(f"MXFP4 needs a reduction dim that is a multiple of {VALUES_PER_SCALE}, got {k}")


def from_checkpoint(blocks: torch.Tensor) -> torch.Tensor:
    """A checkpoint's ``*_blocks`` uint8 [.., N, G, 16] -> packed [.., N, G*16] (the same bytes, a view)."""
    if blocks.dtype != torch.uint8 or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks must be uint8 [.., N, G, 16], got {blocks.dtype} {tuple(blocks.shape)}")
    return blocks.flatten(-2)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed uint8 [.., N, K/2], scales uint8 [.., N, K/32] -> [.., N, K] in ``dtype`` (computed in float32, or
    float64 for float64: exact either way)."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 weights and scales must be uint8, got {packed.dtype} and {scales.dtype}")
    k = packed.shape[-1] * 2
    if tuple(scales.shape) != (*packed.shape[:-1], k // VALUES_PER_SCALE) or k % VALUES_PER_SCALE:
        raise ValueError(f"MXFP4 scales {tuple(scales.shape)} do not fit packed weights {tuple(packed.shape)}: "
                         f"expected {(*packed.shape[:-1], k // VALUES_PER_SCALE)}")
    work = torch.float64 if dtype == torch.float64 else torch.float32
    lut = torch.tensor(E2M1_VALUES, dtype=work, device=packed.device)
    low, high = lut[(packed & 0x0F).long()], lut[(packed >> 4).long()]  # [.., N, K/2] each
    values = torch.stack([low, high], dim=-1).flatten(-2)  # [.., N, K]: low nibble first
    exponents = (scales.to(torch.int32) - SCALE_BIAS).repeat_interleave(VALUES_PER_SCALE, dim=-1)  # [.., N, K]
    return torch.ldexp(values, exponents.to(work)).to(dtype)


@torch.no_grad()
def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [.., N, K] (any float dtype) -> (packed uint8 [.., N, K/2], scales uint8 [.., N, K/32]).

    Each group of 32 gets the smallest power-of-two scale that brings its largest magnitude within 6 (e2m1's
    largest value; clamped to e8m0's range), so nothing saturates, and each value the nearest e2m1 code. Weights
    that are MXFP4 values already (a checkpoint dequantized as read) come back exactly: the same values, though a
    group whose largest code is below 4 gets a smaller scale and larger codes than the checkpoint stored.
    """
    *lead, n, k = weight.shape
    _check_k(k)
    w = weight.to(torch.float64 if weight.dtype == torch.float64 else torch.float32)
    groups = w.unflatten(-1, (k // VALUES_PER_SCALE, VALUES_PER_SCALE))  # [.., N, G, 32]
    amax = groups.abs().amax(dim=-1)  # [.., N, G]
    tiny = torch.finfo(w.dtype).tiny
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax.clamp_min(tiny) / E2M1_MAX)),
                           torch.zeros_like(amax)).clamp(-SCALE_BIAS, SCALE_BIAS)  # [.., N, G]
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)  # [.., N, G, 32], |scaled| <= 6
    magnitudes = torch.tensor(E2M1_VALUES[:8], dtype=w.dtype, device=w.device)
    midpoints = (magnitudes[1:] + magnitudes[:-1]) / 2
    codes = torch.bucketize(scaled.abs().clamp(max=E2M1_MAX), midpoints).to(torch.uint8)  # [.., N, G, 32] in 0..7
    codes |= (scaled < 0).to(torch.uint8) << 3
    pairs = codes.flatten(-2).unflatten(-1, (k // 2, 2))  # [.., N, K/2, 2]
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    return packed.contiguous(), (exponent + SCALE_BIAS).to(torch.uint8)


def check_mxfp4(w: torch.Tensor, scale: torch.Tensor | None, name: str) -> None:
    """ValueError unless ``scale`` is the uint8 [E, N, K/32] scale of packed MXFP4 weight ``w`` uint8 [E, N, K/2]."""
    if scale is None:
        raise ValueError(f"{name} is uint8 (MXFP4) but no {name}_scale was given")
    expected = (*w.shape[:-1], w.shape[-1] * 2 // VALUES_PER_SCALE)
    if scale.dtype != torch.uint8 or tuple(scale.shape) != expected or (w.shape[-1] * 2) % VALUES_PER_SCALE:
        raise ValueError(f"{name}_scale must be uint8 {expected} for MXFP4 {name} {tuple(w.shape)}, "
                         f"got {scale.dtype} {tuple(scale.shape)}")
