"""A step's image work as the forward takes it (``ImageStep``), the same on every tensor-parallel rank.

Rank 0 alone holds the requests, their images, the vision tower and the encoder cache: it builds the step
(``image_step_of``) and ``share_image_step`` hands it to the replica's other ranks, which receive the very tensors
rank 0 computed (positions, image rows, features) rather than computing them again. Why the tower is not
replicated: ``docs/decisions/images-qwen3-vl.md``.

Legend: T the step's rows, n of them image placeholder rows, K deepstack taps, H hidden.
"""

from dataclasses import dataclass

import torch

from engine.distributed.collectives import TensorParallel


@dataclass(frozen=True)
class ImageStep:
    """What one forward needs beyond token ids: its positions (where the model has its own) and the image rows'
    features."""

    positions: torch.Tensor | None  # [3, T] int64 M-RoPE positions (Qwen); None: the batch's (Kimi-K2.5)
    rows: torch.Tensor  # [n] int64: flat rows holding image placeholder tokens
    embeds: torch.Tensor  # [n, H] replacing those rows' token embeddings
    deepstack: torch.Tensor  # [K, n, H] added to those rows after text layers 0..K-1 (K 0 without taps)


def image_step_of(positions: torch.Tensor | None, rows: list[torch.Tensor], embeds: list[torch.Tensor],
                  deepstack: list[torch.Tensor], hidden: int, dtype: torch.dtype, device: torch.device) -> ImageStep:
    """The step from its images' pieces in row order (lists, empty when no image row is in the step; ``deepstack``
    empty for a model without taps), the features in the model's dtype (the forward's own cast, done once here)."""
    n = sum(r.shape[0] for r in rows)
    return ImageStep(
        positions.to(device) if positions is not None else None,
        torch.cat(rows).to(device) if rows else torch.empty(0, dtype=torch.int64, device=device),
        torch.cat(embeds).to(device, dtype) if embeds else torch.empty(0, hidden, dtype=dtype, device=device),
        torch.cat(deepstack, dim=1).to(device, dtype) if deepstack else torch.empty(0, n, hidden, dtype=dtype,
                                                                                    device=device),
    )


def share_image_step(tp: TensorParallel, step: ImageStep | None, num_rows: int, with_positions: bool, hidden: int,
                     dtype: torch.dtype, device: torch.device) -> ImageStep:
    """Rank 0's ``step`` on every rank of ``tp`` (the others pass None): its sizes over the control group (no
    device sync), then one broadcast of its ints (positions [3, T] if ``with_positions``, then the rows) and one
    of its features ([1 + K, n, H]: the embeddings, then the deepstack taps), each skipped when empty."""
    if tp.size == 1:
        return step
    n, taps = tp.broadcast_ints([step.rows.shape[0], step.deepstack.shape[0]] if tp.rank == 0 else None, 2,
                                "broadcast of the step's image rows")
    num_positions = 3 * num_rows if with_positions else 0
    if tp.rank == 0:
        ints = torch.cat([step.positions.reshape(-1), step.rows]) if with_positions else step.rows  # [3T + n]
        features = torch.cat([step.embeds.unsqueeze(0), step.deepstack]).contiguous()  # [1 + K, n, H]
    else:
        ints = torch.empty(num_positions + n, dtype=torch.int64, device=device)
        features = torch.empty(1 + taps, n, hidden, dtype=dtype, device=device)
    tp.broadcast(ints, "broadcast of the step's image positions and rows")
    tp.broadcast(features, "broadcast of the step's image features")
    if tp.rank == 0:
        return step
    return ImageStep(ints[:num_positions].view(3, num_rows) if with_positions else None, ints[num_positions:],
                     features[0], features[1:])
