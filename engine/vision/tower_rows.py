"""A vision tower's stages run over ranges of an image's rows (patches), so that layer-chunked encoding can bound a
step's tower work below one block of one large image.

Each stage of a tower over an image of ``L`` patches is ``2 L`` *passes* (``engine.core.encoder_pieces`` counts
them): the patch embedding (stage 0) embeds row ``r`` in passes ``2r, 2r + 1``; a block (stage ``s`` > 0) first
*projects* every row (passes ``0..L-1``: norm, QKV, rotary; the queries, keys and values kept in the state) and
then *mixes* every row (passes ``L..2L-1``: attention of that query row against all the image's keys, the output
projection, the residual, the MLP), so a pass is half a token-block. A block's projection of all rows comes before
any of its mixing (its keys are every row's), and every row's mixing before the next block's projection (which
reads its output): run in pass order, the rows' results are the unsplit block's, the same math over fewer query
rows at a time. Whole stages run as the unsplit tower does.
"""

from __future__ import annotations

import abc
import dataclasses

import torch


@dataclasses.dataclass
class TowerState:
    """An image part-way through a tower (layer-chunked encoding keeps it between steps): the hidden states after
    the blocks run so far, the rotary angles every block reads, and the taps taken so far (Qwen3-VL's deepstack)."""

    x: torch.Tensor  # [L, D] one row per patch
    cos: torch.Tensor  # [L, head_dim] (MoonViT: [L, head_dim / 2]) float32
    sin: torch.Tensor
    grid_thw: tuple[int, int, int]
    taps: list[torch.Tensor] = dataclasses.field(default_factory=list)  # each [L / m^2, out_hidden]
    # Until every row is embedded (``RowSplitTower.embed_rows``): the pixels [L, C*T*P*P] and positions [L, D].
    pixels: torch.Tensor | None = None
    pos: torch.Tensor | None = None
    # A block part-way (its rows projected, not all mixed): its queries, keys and values, each [L, heads, head_dim].
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Mergers after a block part-way (Qwen3-VL): merge windows done so far, their outputs, each [L / m^2, width].
    merged: int = 0
    merged_out: list[torch.Tensor] | None = None
    final: torch.Tensor | None = None  # [L / m^2, out_hidden] the final merger's, when run as the rows were mixed


class RowSplitTower(abc.ABC):
    """Mixed into a tower module with ``blocks`` whose each block has ``project(x, cos, sin) -> (q, k, v)`` and
    ``mix(x, q, k, v) -> x`` (``forward`` being ``mix(x, *project(x, cos, sin))``) and ``attention_width`` (its
    queries' heads x head dim: what one query row's attention against each key costs, counted by the scheduler's
    budget, ``engine.models.encoder_budget.attention_per_patch``); the tower says how it starts an
    image (``start``), embeds its rows (``embed_rows``) and what follows a block (``after_block``: taps; and
    ``after_rows``, as a block's rows are mixed, for work on finished rows)."""

    @abc.abstractmethod
    def start(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> TowerState:
        """One image's state before any stage: its pixels and positions kept, its rows not yet embedded."""

    @abc.abstractmethod
    def embed_rows(self, state: TowerState, a: int, b: int) -> None:
        """Rows ``a:b`` of the patch embedding into ``state.x``."""

    def after_rows(self, state: TowerState, i: int, b: int) -> None:
        """After block ``i`` has mixed rows ``0:b`` (row by row only: work on finished rows, spread over pieces)."""

    def after_block(self, state: TowerState, i: int) -> None:
        """After block ``i`` has run over every row (taps taken here)."""

    def run_blocks(self, state: TowerState, first: int, end: int) -> None:
        """Blocks ``first..end-1`` over ``state`` (which has run blocks ``0..first-1``), whole."""
        for i in range(first, end):
            state.x = self.blocks[i](state.x, state.cos, state.sin)
            self.after_block(state, i)

    def project_rows(self, state: TowerState, i: int, a: int, b: int) -> None:
        """Block ``i``'s projection of rows ``a:b`` into the state's queries, keys and values."""
        q, k, v = self.blocks[i].project(state.x[a:b], state.cos[a:b], state.sin[a:b])  # each [b - a, h, d]
        if state.qkv is None:
            state.qkv = tuple(t.new_empty(state.x.shape[0], *t.shape[1:]) for t in (q, k, v))  # each [L, h, d]
        for buf, rows in zip(state.qkv, (q, k, v)):
            buf[a:b] = rows

    def mix_rows(self, state: TowerState, i: int, a: int, b: int) -> None:
        """Block ``i``'s mixing of rows ``a:b`` (every row projected): their outputs replace them in ``state.x``
        (no other row reads them before the next block)."""
        q, k, v = state.qkv
        state.x[a:b] = self.blocks[i].mix(state.x[a:b], q[a:b], k, v)
        self.after_rows(state, i, b)
        if b == state.x.shape[0]:
            state.qkv = None
            self.after_block(state, i)

    def run_passes(self, state: TowerState, first: int, end: int) -> None:
        """Passes ``first..end-1`` of the tower (stage ``s`` holds passes ``2Ls..2L(s+1)-1``) over ``state``, which
        has run passes ``0..first-1``."""
        length = state.x.shape[0]
        per = 2 * length
        u = first
        while u < end:
            s, lo = divmod(u, per)
            hi = min(end, (s + 1) * per) - s * per
            if s == 0:
                a, b = (lo + 1) // 2, (hi + 1) // 2  # row r: passes 2r, 2r + 1 (none: the piece is pass 2r + 1)
                if a < b:
                    self.embed_rows(state, a, b)
                if hi == per:
                    state.pixels = state.pos = None  # embedded: not needed again
            elif lo == 0 and hi == per:
                self.run_blocks(state, s - 1, s)
            else:
                if lo < length:
                    self.project_rows(state, s - 1, lo, min(hi, length))
                if hi > length:
                    self.mix_rows(state, s - 1, max(lo, length) - length, hi - length)
            u = s * per + hi
