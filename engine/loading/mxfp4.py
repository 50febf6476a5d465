"""MXFP4 checkpoint tensors (gpt-oss's routed experts), dequantized as they are read, on the CPU.

A weight W [.., N, K] is stored as two tensors: ``<name>_blocks`` uint8 [.., N, K/32, 16], two FP4 (e2m1)
values per byte (element 2j in the low nibble, 2j+1 in the high one), and ``<name>_scales`` uint8 [.., N, K/32],
one power-of-two scale per 32 consecutive values of a row, as an e8m0 exponent biased by 127:
W[.., n, 32g + i] = e2m1(code) * 2**(scales[.., n, g] - 127).

Dequantized values are exact in bfloat16 and float32 (a 2-bit mantissa times a power of two). The format and its
arithmetic are ``moe_kernels.mxfp4``'s (whose packed layout is these blocks with their last two dims merged);
``--quantization mxfp4`` keeps the experts in it (``engine.loading.quantization``).
"""

import torch

from engine.core.model_config import CheckpointError, ModelConfig
from moe_kernels import mxfp4 as mx

BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


def declared(model_config: ModelConfig) -> bool:
    """Whether the checkpoint's config.json says its experts are MXFP4 (``quant_method: mxfp4``)."""
    qc = model_config.cfg("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    return bool(qc) and qc.get("quant_method") == "mxfp4"


def is_blocks(name: str) -> bool:
    return name.endswith(BLOCKS_SUFFIX)


def weight_name(name: str) -> str:
    """The weight an MXFP4 ``<name>_blocks`` tensor stores (other names unchanged)."""
    return name[:-len(BLOCKS_SUFFIX)] if is_blocks(name) else name


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [.., N, G, 16], scales uint8 [.., N, G] -> [.., N, G * 32] in ``dtype``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} must be scales {tuple(scales.shape)} + (16,)")
    return mx.dequantize_mxfp4(mx.from_checkpoint(blocks), scales, dtype)


class Mxfp4Reader:
    """Reads ``<name>_blocks`` with its ``<name>_scales``, from whichever checkpoint file holds each."""

    def __init__(self, files: list[str]) -> None:
        from safetensors import safe_open

        self.where: dict[str, str] = {}
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                self.where.update(dict.fromkeys(f.keys(), path))

    def is_scales(self, name: str) -> bool:
        """A ``_scales`` tensor read with its ``_blocks`` (skipped on its own)."""
        return name.endswith(SCALES_SUFFIX) and name[:-len(SCALES_SUFFIX)] + BLOCKS_SUFFIX in self.where

    def dequantized(self, f, name: str, path: str) -> torch.Tensor:
        """Blocks tensor ``name`` (in open file ``f``) with its scales -> float32 [.., N, K]."""
        from safetensors import safe_open

        scales_name = weight_name(name) + SCALES_SUFFIX
        if scales_name not in self.where:
            raise CheckpointError(f"{path}: MXFP4 tensor {name} has no {scales_name}")
        with safe_open(self.where[scales_name], framework="pt", device="cpu") as g:
            scales = g.get_tensor(scales_name)
        try:
            return dequantize_mxfp4(f.get_tensor(name), scales)
        except ValueError as e:
            raise CheckpointError(f"{path}: {name}: {e}") from None
