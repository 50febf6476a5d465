"""The flat batch one forward takes: every scheduled token in one row, decodes first (``engine.worker.batch_builder``
builds it). Legend: T scheduled tokens, D decode requests, N sampled rows, Q scored prompt rows, W block-table width."""

from dataclasses import dataclass

import torch

from engine.device_batch.attention_metadata import AttentionMetadata, TritonAttentionMetadata


@dataclass(slots=True)
class FlatBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata | TritonAttentionMetadata
    # [N] int64: flat row of the last token of each sampling request, in scheduled order (the last K + 1 rows
    # of a request with K drafts: N counts rows, not requests)
    sample_rows: torch.Tensor
    prompt_rows: torch.Tensor  # [Q] int64: flat rows scoring prompt tokens (prompt logprobs), in scheduled order
    num_decodes: int  # D; a batch with T == D is decode-only (CUDA-graph eligible)
    max_blocks: int  # W of the widest decode table
    # Flat rows [start, end) of each scheduled part, in scheduled order (per-request data such as LoRA slots).
    scheduled_ranges: tuple[tuple[int, int], ...] = ()
