"""What one attention layer keeps per token in the paged KV cache: the runner allocates what the spec says."""

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """The cache tensors of one attention layer, by their shape per token.

    Each entry of ``per_token`` becomes one tensor ``[num_blocks + 1, block_size, *shape]``: (K, V) of
    ``[kv_heads, head_dim]`` each for standard attention, one ``[kv_lora_rank + rope_dim]`` latent row for
    multi-head latent attention. ``dtype`` None: the model's dtype.
    """

    per_token: tuple[tuple[int, ...], ...]
    dtype: torch.dtype | None = None

    def values_per_token(self) -> int:
        return sum(math.prod(shape) for shape in self.per_token)

    def bytes_per_token(self, model_dtype: torch.dtype) -> int:
        return self.values_per_token() * (self.dtype or model_dtype).itemsize
