"""What one attention layer keeps per token in the paged KV cache: the runner allocates what the spec says."""

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """The cache tensors of one attention layer, by their shape per token.

    Each entry of ``per_token`` becomes one tensor ``[num_blocks + 1, block_size, *shape]``: (K, V) of
    ``[kv_heads, head_dim]`` each for standard attention, one ``[kv_lora_rank + rope_dim]`` latent row for
    multi-head latent attention (and sparse attention's indexer keys beside it). ``dtype`` None: the model's
    dtype. ``entry_dtypes``: a dtype per entry where entries differ (None in it: ``dtype``); empty: all ``dtype``.
    """

    per_token: tuple[tuple[int, ...], ...]
    dtype: torch.dtype | None = None
    entry_dtypes: tuple[torch.dtype | None, ...] = ()

    def values_per_token(self) -> int:
        return sum(math.prod(shape) for shape in self.per_token)

    def entry_dtype(self, index: int, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype of entry ``index``'s tensor."""
        own = self.entry_dtypes[index] if index < len(self.entry_dtypes) else None
        return own or self.dtype or model_dtype

    def bytes_per_token(self, model_dtype: torch.dtype) -> int:
        return sum(math.prod(shape) * self.entry_dtype(i, model_dtype).itemsize
                   for i, shape in enumerate(self.per_token))


@dataclass(frozen=True, slots=True)
class StateSpec:
    """The fixed-size state one linear-attention layer keeps per running request (whatever its length).

    ``conv``: the last ``kernel - 1`` inputs of its short convolution, ``[channels, kernel - 1]`` in the model's
    dtype; ``recurrent``: its key-to-value state, ``[heads, key_dim, value_dim]`` in float32 (it accumulates over
    every token, so it is kept at the precision the reference computes it in). DeepSeek-V4's layers keep their
    rows of recent tokens flat in ``conv`` (``engine.layers.window_rings``) with an empty ``recurrent``.
    """

    conv: tuple[int, ...]
    recurrent: tuple[int, ...]
    recurrent_dtype: torch.dtype = torch.float32

    def bytes_per_slot(self, model_dtype: torch.dtype) -> int:
        return math.prod(self.conv) * model_dtype.itemsize + math.prod(self.recurrent) * self.recurrent_dtype.itemsize
