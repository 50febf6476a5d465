"""The flat-batch metadata one forward needs, built once per step and shared by every layer."""

from dataclasses import dataclass
from typing import Any

import torch

from engine.device_batch.state_metadata import StateMetadata


@dataclass(slots=True)
class DecodeGroup:
    """Decode requests whose queries are flat tokens [start, end). Legend: G requests, L padded context."""

    start: int
    end: int
    block_table: torch.Tensor  # [G, max_blocks] int64 (padding points at block 0 and is masked)
    key_mask: torch.Tensor  # [G, 1, 1, L] bool: True where a key is visible
    # Blocks at the head of every table in the group (a shared prompt prefix): attended once for all
    # G queries, then merged with each request's own blocks (``block_table``) by log-sum-exp.
    shared_blocks: torch.Tensor | None = None  # [S] int64
    # Key columns [lo, hi) of ``block_table`` that every request of the group sees (host ints): reading the cache,
    # only the columns outside it can hold slots to zero (``paged_attention.gather_visible``). (0, 0): none known.
    seen_by_all: tuple[int, int] = (0, 0)


@dataclass(slots=True)
class AttentionMetadata:
    """Legend: T scheduled tokens, B requests, D decode requests, P prefill requests, L context.

    Requests are ordered decodes first (one query token each), then prefills
    (several query tokens, possibly over a cached or already computed prefix).
    """

    slot_mapping: torch.Tensor  # [T] int64: flat KV slot (block_id * block_size + offset) of each token
    num_decodes: int  # D: the first D tokens are the D decode requests' queries
    # Decodes in groups of similar context length, each padded to its own longest context
    # (the torch path; a Triton paged-attention kernel takes the block tables directly on GPU).
    decode_groups: list["DecodeGroup"]
    # Prefills, one entry per request: query token range, its context and mask.
    prefill_query_ranges: list[tuple[int, int]]  # (start, end) into the flat token dim
    prefill_block_tables: list[torch.Tensor]  # each [n_blocks] int64
    prefill_seq_lens: list[int]  # context length including this chunk
    # each [1, 1, q_len, L] bool; None for a chunk that starts at position 0 without a sliding window:
    # its keys are exactly its own tokens, so it runs causal attention on them with no cache read.
    prefill_masks: list[torch.Tensor | None]
    # Models whose layers differ in window (gpt-oss: ``ModelConfig.layer_sliding_window``): the same batch with
    # the masks of that window, for the layers that use it (and their own slots and block tables where those
    # layers are a cache group of their own); None when every layer reads the masks above.
    windowed: "AttentionMetadata | None" = None
    # Hybrid models: each request's state slot, read by the linear-attention layers (None: no such layers).
    states: StateMetadata | None = None
    # Image-text models: the step's M-RoPE positions and image rows (``engine.models.image_step.ImageStep``),
    # carried with the batch so a step prepared while another is in flight keeps its own; None for other models.
    images: Any = None

    def for_window(self, own_window: bool) -> "AttentionMetadata":
        """The metadata a layer reads: ``windowed`` for a layer with its own window, else this."""
        if not own_window:
            return self
        if self.windowed is None:
            raise RuntimeError("a layer with its own sliding window needs a batch built with layer_window")
        return self.windowed


@dataclass(slots=True)
class TritonAttentionMetadata:
    """What the Triton paged-attention kernels read: block tables and lengths, no masks.

    Legend: T scheduled tokens, D decode requests, P prefill chunks, W block-table width,
    n query tiles. Requests are ordered decodes first (token i is decode i), then prefills.
    All tensors are int64 on the device (one staged host-to-device copy per step).
    """

    slot_mapping: torch.Tensor  # [T]
    num_decodes: int  # D
    decode_block_table: torch.Tensor  # [D, W]; rows past a request's blocks are never read
    decode_seq_lens: torch.Tensor  # [D] context length including the new token (0: a padding row)
    decode_splits: int  # S: each request's keys are split over S programs, then merged (flash decoding)
    num_prefills: int  # P
    prefill_block_table: torch.Tensor  # [P, W]
    prefill_seq_lens: torch.Tensor  # [P] context length including the chunk
    prefill_query_start: torch.Tensor  # [P] flat index of each chunk's first query token
    prefill_query_len: torch.Tensor  # [P]
    prefill_tile_req: torch.Tensor  # [n] the chunk of each BLOCK_M-query tile
    prefill_tile_start: torch.Tensor  # [n] offset of the tile's first query within its chunk
    sliding_window: int = 0  # 0: none
    # (first flat token, query length, context length) of each prefill chunk, on the host: what a path that loops
    # over the chunks in Python (MLA's expanded prefill) reads without copying the device tensors back.
    prefill_extents: tuple[tuple[int, int, int], ...] = ()
    # The sliding-window layers' own cache group: the same batch over that group's slots and block tables
    # (lengths and tiles shared); None when every layer reads the tables above.
    windowed: "TritonAttentionMetadata | None" = None
    states: StateMetadata | None = None  # as ``AttentionMetadata.states``
    images: Any = None  # as ``AttentionMetadata.images``

    def for_window(self, own_window: bool) -> "TritonAttentionMetadata":
        """The metadata a layer reads: ``windowed`` for a layer with its own window where the batch has it (the
        kernels take the layer's window as an argument), else this."""
        return self.windowed if own_window and self.windowed is not None else self
