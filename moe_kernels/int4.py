"""INT4 expert weights: signed 4-bit integers with one scale per group of 32 values along K (symmetric, no zero point).

Legend: N output channels (rows), K reduction dim (columns) of one weight [.., N, K]; K must be a multiple of 32.

The layout is compressed-tensors' ``pack-quantized`` format as Kimi-K2-Thinking, Kimi-K2.5 and Kimi-K2.6 publish
their routed experts (``num_bits`` 4, ``symmetric``, ``strategy: group``, ``group_size`` 32), kept as stored:

- ``packed`` int32 [.., N, K/8]: word j of a row holds values 8j .. 8j+7, value 8j+i in bits 4i..4i+3 (the lowest
  nibble first), each stored offset by 8: a nibble c means the integer c - 8, in [-8, 7].
- ``scales`` [.., N, K/32] in bfloat16 (as published; float32 accepted): W[.., n, k] = (q * scales[.., n, k // 32])
  rounded to the scales' dtype, which is how compressed-tensors (and transformers through it) dequantizes: the
  product is taken in the scale's dtype. In float32 and bfloat16 activations that is the weight exactly.

4.5 bits a weight with bfloat16 scales (against 16 for bfloat16 weights). Plain torch; ``moe_kernels.int4_triton``
reads the same layout inside the Triton kernels.
"""

import sys

import torch

GROUP_SIZE = 32
VALUES_PER_WORD = 8
OFFSET = 8  # stored nibble = value + 8
INT4_MAX = 7  # symmetric scales map a group's largest magnitude onto 7.5 (compressed-tensors' minmax observer)
SCALE_DTYPES = (torch.bfloat16, torch.float32)
_SHIFTS = tuple(4 * i for i in range(VALUES_PER_WORD))


def _check_k(k: int) -> None:
    if k % GROUP_SIZE:
        raise ValueError(f"INT4 needs a reduction dim that is a multiple of {GROUP_SIZE}, got {k}")


def packed_shape(weight_shape: tuple[int, ...]) -> tuple[int, ...]:
    """[.., N, K] -> the packed words' shape [.., N, K/8]."""
    *lead, n, k = weight_shape
    _check_k(k)
    return (*lead, n, k // VALUES_PER_WORD)


def scale_shape(weight_shape: tuple[int, ...]) -> tuple[int, ...]:
    """[.., N, K] -> the scales' shape [.., N, K/32]."""
    *lead, n, k = weight_shape
    _check_k(k)
    return (*lead, n, k // GROUP_SIZE)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """packed int32 [.., N, K/8] -> int8 [.., N, K] in [-8, 7]."""
    if packed.dtype != torch.int32:
        raise ValueError(f"INT4 weights must be packed int32, got {packed.dtype}")
    if sys.byteorder == "little" and packed.is_contiguous():
        # Byte b of word j holds values 8j + 2b (low nibble) and 8j + 2b + 1 (high): the bytes in memory order are
        # the value pairs in K order. Byte ops: several times faster than shifting whole words on the CPU.
        pairs = packed.view(torch.uint8)  # [.., N, K/2]
        nibbles = torch.stack([pairs & 0xF, pairs >> 4], dim=-1).flatten(-2)  # [.., N, K]
        return nibbles.view(torch.int8) - OFFSET
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [.., N, K/8, 8]: value 8j + i at [.., j, i]
    return (nibbles - OFFSET).to(torch.int8).flatten(-2)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int [.., N, K] in [-8, 7] -> packed int32 [.., N, K/8]."""
    *lead, n, k = q.shape
    if k % VALUES_PER_WORD:
        raise ValueError(f"INT4 packing needs a reduction dim that is a multiple of {VALUES_PER_WORD}, got {k}")
    nibbles = (q.to(torch.int32) + OFFSET).unflatten(-1, (k // VALUES_PER_WORD, VALUES_PER_WORD))  # [.., N, K/8, 8]
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=q.device)
    # The nibbles occupy disjoint bits: their sum is their bitwise or (bit 31 wraps into the int32 sign, as stored).
    return (nibbles << shifts).sum(dim=-1, dtype=torch.int32)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed int32 [.., N, K/8], scales [.., N, K/32] -> [.., N, K] in ``dtype``: q * scale rounded to the scales'
    dtype (compressed-tensors' arithmetic), then cast to ``dtype``."""
    k = packed.shape[-1] * VALUES_PER_WORD
    if tuple(scales.shape) != (*packed.shape[:-1], k // GROUP_SIZE) or k % GROUP_SIZE:
        raise ValueError(f"INT4 scales {tuple(scales.shape)} do not fit packed weights {tuple(packed.shape)}: "
                         f"expected {(*packed.shape[:-1], k // GROUP_SIZE)}")
    q = unpack_int4(packed).unflatten(-1, (k // GROUP_SIZE, GROUP_SIZE))  # [.., N, G, 32]
    # A 4-bit integer times the scale, in the scale's dtype: torch multiplies bfloat16 in float32 (exact here) and
    # rounds once, to nearest even, as compressed-tensors' dequantize does.
    values = q.to(scales.dtype) * scales.unsqueeze(-1)  # [.., N, G, 32]
    return values.flatten(-2).to(dtype)


@torch.no_grad()
def quantize_int4(weight: torch.Tensor, scale_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [.., N, K] -> (packed int32 [.., N, K/8], scales [.., N, K/32] in ``scale_dtype``).

    As compressed-tensors' symmetric minmax quantizer: each group's scale maps its largest magnitude onto 7.5
    (half the int4 range), each value the nearest integer of value / scale, clamped to [-8, 7]. An all-zero group
    gets scale 1. Works on the meta device (shapes only).
    """
    *lead, n, k = weight.shape
    _check_k(k)
    w = weight.to(torch.float64 if weight.dtype == torch.float64 else torch.float32)
    groups = w.unflatten(-1, (k // GROUP_SIZE, GROUP_SIZE))  # [.., N, G, 32]
    amax = groups.abs().amax(dim=-1)  # [.., N, G]
    scale = torch.where(amax > 0, amax / (INT4_MAX + 0.5), torch.ones_like(amax)).to(scale_dtype)
    q = (groups / scale.to(w.dtype).unsqueeze(-1)).round().clamp(-OFFSET, INT4_MAX)  # [.., N, G, 32]
    return pack_int4(q.flatten(-2)), scale


def check_int4(w: torch.Tensor, scale: torch.Tensor | None, name: str) -> None:
    """ValueError unless ``scale`` is the [E, N, K/32] scale of packed INT4 weight ``w`` int32 [E, N, K/8]."""
    if scale is None:
        raise ValueError(f"{name} is int32 (packed INT4) but no {name}_scale was given")
    expected = (*w.shape[:-1], w.shape[-1] * VALUES_PER_WORD // GROUP_SIZE)
    if scale.dtype not in SCALE_DTYPES or tuple(scale.shape) != expected or (w.shape[-1] * VALUES_PER_WORD) % GROUP_SIZE:
        raise ValueError(f"{name}_scale must be bfloat16 or float32 {expected} for INT4 {name} {tuple(w.shape)}, "
                         f"got {scale.dtype} {tuple(scale.shape)}")
