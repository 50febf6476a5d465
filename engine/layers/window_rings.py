"""DeepSeek-V4's per-request state: the recent rows each attention layer still needs, in rings.

A layer keeps, per running request (one state slot, ``engine.core.state_slots``), a few row streams each as a
ring of ``size`` rows indexed by position modulo ``size``: its key rows for the sliding window, and for a
compressed layer its compressor's (and CSA's indexer's) raw projections of the compression window not yet
complete (CSA: and the one before it, whose first halves the next entry mixes in). All streams of a layer live in
one flat row of the state cache (``StateSpec.conv``: flat values in the model's dtype; no float32 part), so the
prefix cache's state checkpoints copy them as they copy a linear-attention layer's state.

A step reads the rows of positions [lo, p0) a stream still holds (p0: the request's first position this step),
appends the step's own rows, and writes back the rows the next step needs. At p0 = 0 nothing is read, so a
fresh request (or one recomputed after preemption) never sees what its slot held before.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Ring:
    """One stream: ``size`` rows of ``width`` values at ``offset`` in the layer's flat state row."""

    offset: int
    size: int
    width: int

    @property
    def values(self) -> int:
        return self.size * self.width

    def rows(self, state: torch.Tensor) -> torch.Tensor:
        """state [S] (one slot's flat row) -> this ring's rows [size, width], a view."""
        return state[self.offset:self.offset + self.values].view(self.size, self.width)

    def extend(self, state: torch.Tensor, lo: int, p0: int, new: torch.Tensor) -> torch.Tensor:
        """The rows of positions [lo, p0 + n): those [lo, p0) it holds (p0 - lo <= size), then ``new`` [n, width]
        (rounded to the state's dtype, as a cached row is) -> [p0 + n - lo, width]."""
        assert 0 <= p0 - lo <= self.size, (lo, p0, self.size)
        held = self.rows(state).index_select(0, torch.arange(lo, p0, device=state.device) % self.size)
        return torch.cat([held, new.to(state.dtype)])

    def keep(self, state: torch.Tensor, rows: torch.Tensor, first: int, lo_next: int) -> None:
        """Write back the rows [first, first + len(rows)) at or after ``lo_next`` (what the next step reads;
        at most ``size`` of them)."""
        end = first + rows.shape[0]
        lo_next = max(lo_next, first)
        assert end - lo_next <= self.size, (lo_next, end, self.size)
        positions = torch.arange(lo_next, end, device=state.device)
        self.rows(state).index_copy_(0, positions % self.size, rows[lo_next - first:])


def layout(sizes_widths: list[tuple[int, int]]) -> list[Ring]:
    """Consecutive rings of (rows, width) each."""
    rings, offset = [], 0
    for size, width in sizes_widths:
        rings.append(Ring(offset, size, width))
        offset += size * width
    return rings
