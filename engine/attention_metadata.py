"""The flat-batch metadata one forward needs, built once per step and shared by every layer."""

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Legend: T scheduled tokens, B requests, D decode requests, P prefill requests, L context.

    Requests are ordered decodes first (one query token each), then prefills
    (several query tokens, possibly over a cached or already computed prefix).
    """

    slot_mapping: torch.Tensor  # [T] int64: flat KV slot (block_id * block_size + offset) of each token
    num_decodes: int  # D: the first D tokens are the D decode requests' queries
    # Decode batch, padded to the longest context (a torch path that a Triton kernel replaces on GPU).
    decode_block_tables: torch.Tensor | None  # [D, max_blocks] int64
    decode_seq_lens: torch.Tensor | None  # [D] int64: context length including the new token
    decode_key_mask: torch.Tensor | None  # [D, 1, 1, L] bool: True where a key is visible
    # Prefills, one entry per request: query token range, its context and mask.
    prefill_query_ranges: list[tuple[int, int]]  # (start, end) into the flat token dim
    prefill_block_tables: list[torch.Tensor]  # each [n_blocks] int64
    prefill_seq_lens: list[int]  # context length including this chunk
    prefill_masks: list[torch.Tensor]  # each [1, q_len, L] bool
