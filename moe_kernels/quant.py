"""8-bit expert weights: quantizing, dequantizing, and the scale layouts the kernels read.

Legend: N output channels (rows), K reduction dim (columns) of one weight [.., N, K].

Two formats, both symmetric (no zero point) with float32 scales, dequantized as ``w = q * scale``:

- ``fp8``: ``torch.float8_e4m3fn`` values (largest 448). Scales per output channel ``[.., N]``, or
  per ``block_n x block_k`` block ``[.., ceil(N/block_n), ceil(K/block_k)]`` (the 128x128 blocks of
  published FP8 MoE checkpoints, whose ``weight_scale_inv`` is this multiplier).
- ``int8``: ``torch.int8`` values in [-127, 127], scales per output channel ``[.., N]``. Activations stay
  in the model dtype (weight-only).

A packed gate/up weight w13 [E, 2I, H] is two weights: with block scales its blocks restart at row I
(``halves=2``), so the scales are [E, 2*ceil(I/block_n), ceil(H/block_k)], gate blocks then up blocks, as
the two checkpoint tensors it is packed from have them.

4-bit formats keep their own modules: MXFP4 (uint8, ``moe_kernels.mxfp4``) and INT4 (packed int32 with a scale per
32 values, ``moe_kernels.int4``); the weight's dtype tells them apart.

Everything here is plain torch and runs on the meta device (shapes only).
"""

from dataclasses import dataclass

import torch

from moe_kernels import int4
from moe_kernels.mxfp4 import check_mxfp4, dequantize_mxfp4, packed_shape, quantize_mxfp4

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127  # symmetric: -128 is never produced
METHODS = ("fp8", "int8", "mxfp4", "int4")


@dataclass(frozen=True, slots=True)
class QuantScheme:
    """How weights are stored: ``method`` "fp8", "int8", "mxfp4" (4 bits, ``moe_kernels.mxfp4``) or "int4" (packed
    int32, ``moe_kernels.int4``); ``block`` (block_n, block_k) scales (fp8 only) or None for one scale per output
    channel (per 32 values for mxfp4 and int4)."""

    method: str
    block: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"quantization method must be one of {METHODS}, got {self.method!r}")
        if self.block is not None:
            if self.method != "fp8":
                raise ValueError("block scales are for fp8; int8 has one scale per output channel")
            if len(self.block) != 2 or min(self.block) < 1:
                raise ValueError(f"block must be two positive sizes (block_n, block_k), got {self.block}")

    @property
    def dtype(self) -> torch.dtype:
        return {"fp8": FP8_DTYPE, "int8": torch.int8, "mxfp4": torch.uint8, "int4": torch.int32}[self.method]

    def stored_shape(self, weight_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The stored weight's shape for a weight [.., N, K]: the same, [.., N, K/2] for mxfp4's packed bytes,
        [.., N, K/8] for int4's packed words."""
        if self.method == "int4":
            return int4.packed_shape(weight_shape)
        return packed_shape(weight_shape) if self.method == "mxfp4" else tuple(weight_shape)


def scale_shape(weight_shape: tuple[int, ...], block: tuple[int, int] | None, halves: int = 1) -> tuple[int, ...]:
    """The scale tensor's shape for a weight [.., N, K] made of ``halves`` weights stacked along N."""
    *lead, n, k = weight_shape
    if block is None:
        return (*lead, n)
    return (*lead, halves * -(-(n // halves) // block[0]), -(-k // block[1]))


def _expand_blocks(scale: torch.Tensor, n: int, k: int, block: tuple[int, int]) -> torch.Tensor:
    """[.., N/bn, K/bk] -> [.., N, K]: each block's scale over its elements (edge blocks cut)."""
    return scale.repeat_interleave(block[0], dim=-2)[..., :n, :].repeat_interleave(block[1], dim=-1)[..., :k]


@torch.no_grad()
def quantize(weight: torch.Tensor, scheme: QuantScheme, halves: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [.., N, K] (any float dtype) -> (q [.., N, K] in ``scheme.dtype``, scale float32, see ``scale_shape``).

    The scale maps each channel's (or block's) largest magnitude onto the format's largest value; an
    all-zero channel gets scale 1. Computed in float32 (float64 input stays float64 until the cast).
    ``halves=2`` for a packed gate/up weight: block scales restart at its middle row.
    mxfp4: (packed uint8 [.., N, K/2], uint8 scales [.., N, K/32]), see ``moe_kernels.mxfp4``; int4: (packed int32
    [.., N, K/8], bfloat16 scales [.., N, K/32]), see ``moe_kernels.int4``.
    """
    if scheme.method == "mxfp4":
        return quantize_mxfp4(weight)
    if scheme.method == "int4":
        return int4.quantize_int4(weight)
    if halves > 1 and scheme.block is not None:
        parts = [quantize(part, scheme) for part in weight.chunk(halves, dim=-2)]
        return torch.cat([q for q, _ in parts], dim=-2), torch.cat([s for _, s in parts], dim=-2)
    w = weight if weight.dtype == torch.float64 else weight.to(torch.float32)
    *_, n, k = w.shape
    limit = FP8_MAX if scheme.method == "fp8" else float(INT8_MAX)
    if scheme.block is None:
        amax = w.abs().amax(dim=-1)  # [.., N]
    else:
        bn, bk = scheme.block
        pad_n, pad_k = -n % bn, -k % bk
        padded = torch.nn.functional.pad(w.abs(), (0, pad_k, 0, pad_n))  # [.., N', K'], zeros do not raise amax
        amax = padded.unflatten(-1, (-1, bk)).unflatten(-3, (-1, bn)).amax(dim=(-3, -1))  # [.., N'/bn, K'/bk]
    scale = torch.where(amax > 0, amax / limit, torch.ones_like(amax))
    full = scale.unsqueeze(-1) if scheme.block is None else _expand_blocks(scale, n, k, scheme.block)
    scaled = w / full
    if scheme.method == "fp8":
        q = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # round to nearest even
    else:
        q = scaled.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale.to(torch.float32)


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
               dtype: torch.dtype = torch.float32, halves: int = 1) -> torch.Tensor:
    """q [.., N, K] and its scale -> [.., N, K] in ``dtype`` (the product taken in float32, or float64 for float64)."""
    if q.dtype == torch.uint8:
        return dequantize_mxfp4(q, scale, dtype)
    if q.dtype == torch.int32:
        return int4.dequantize_int4(q, scale, dtype)
    if halves > 1 and block is not None:
        parts = zip(q.chunk(halves, dim=-2), scale.chunk(halves, dim=-2))
        return torch.cat([dequantize(q_h, s_h, block, dtype) for q_h, s_h in parts], dim=-2)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    *_, n, k = q.shape
    full = scale.to(work).unsqueeze(-1) if block is None else _expand_blocks(scale.to(work), n, k, block)
    return (q.to(work) * full).to(dtype)


def check_scales(w: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None, name: str,
                 halves: int = 1) -> None:
    """ValueError unless ``scale`` fits the 8-bit weight ``w`` [E, N, K] (None: ``w`` must be a float weight)."""
    if w.dtype == torch.uint8:
        if block is not None:
            raise ValueError("block_shape is for 8-bit weights; MXFP4 (uint8) weights have their own groups of 32")
        check_mxfp4(w, scale, name)
        return
    if w.dtype == torch.int32:
        if block is not None:
            raise ValueError("block_shape is for 8-bit weights; INT4 (int32) weights have their own groups of 32")
        int4.check_int4(w, scale, name)
        return
    quantized = w.dtype in (FP8_DTYPE, torch.int8)
    if scale is None:
        if quantized:
            raise ValueError(f"{name} is {w.dtype} but no {name}_scale was given")
        return
    if not quantized:
        raise ValueError(f"{name}_scale given for a {w.dtype} {name}; scales go with float8_e4m3fn or int8 weights")
    if block is not None and w.dtype != FP8_DTYPE:
        raise ValueError("block scales are for float8_e4m3fn weights")
    expected = scale_shape(tuple(w.shape), block, halves)
    if tuple(scale.shape) != expected or scale.dtype != torch.float32:
        raise ValueError(f"{name}_scale must be float32 {expected} for {name} {tuple(w.shape)} "
                         f"(block {block}), got {scale.dtype} {tuple(scale.shape)}")
