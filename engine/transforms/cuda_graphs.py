"""CUDA graphs for decode-only steps: a transform on the runner's model call, not a branch in the models.

Legend: B a captured batch size, n decode requests this step (n <= B), W block-table width, H hidden.

A decode step launches a few hundred small kernels whose launch cost, at small
batches, exceeds their run time. At start we capture the model's forward once
per batch size in ``sizes`` over static input buffers; a decode-only step is
then padded up to the nearest captured size, its metadata copied into the
static buffers (device-to-device, no host sync) and the graph replayed.

Padding rows are inert: token 0 at position 0, K/V written to the runner's
scratch block (which no request owns), context length 0 (attention reads
nothing and writes zeros). Their MoE routing is real work on garbage tokens,
which the layers' expert-load counters leave out: they count only the rows
[0, n) (``engine.transforms.real_rows``), and the warm-up run before each
capture (all padding) counts nothing.

Only the Triton attention path is captured: its metadata is fixed-shape
tensors; the torch path's metadata is per-step Python structure.
``capture=False`` runs the same padding and static-buffer code eagerly: that
is how the CPU tests exercise everything here but the capture itself.
"""

import bisect
import logging
from dataclasses import dataclass, replace

import torch

from engine.core.config import CacheConfig
from engine.device_batch.attention_metadata import TritonAttentionMetadata
from engine.device_batch.flat_batch import FlatBatch
from engine.kernels.attention import decode_splits
from engine.transforms.real_rows import RealRows

logger = logging.getLogger(__name__)


def default_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8, up to and including ``max_num_seqs``."""
    sizes = {s for s in (1, 2, 4, 8) if s <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 8))
    sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


def pick_batch_size(num_decodes: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size that holds ``num_decodes`` requests (sizes sorted), or None if none does."""
    i = bisect.bisect_left(sizes, num_decodes)
    return sizes[i] if i < len(sizes) else None


@dataclass(slots=True)
class StaticDecodeBuffers:
    """The tensors a captured graph reads; each step's metadata is copied into their first rows."""

    input_ids: torch.Tensor  # [B_max] int64
    positions: torch.Tensor  # [B_max] int64
    slot_mapping: torch.Tensor  # [B_max] int64
    block_table: torch.Tensor  # [B_max, W_max] int64
    seq_lens: torch.Tensor  # [B_max] int64
    empty: torch.Tensor  # [0] int64: the (absent) prefill fields
    # The sliding-window layers' own cache group (``TritonAttentionMetadata.windowed``), or None: one group.
    window_slot_mapping: torch.Tensor | None = None  # [B_max] int64
    window_block_table: torch.Tensor | None = None  # [B_max, W_max] int64

    @classmethod
    def allocate(cls, max_batch: int, max_blocks: int, device: torch.device,
                 window_tables: bool = False) -> "StaticDecodeBuffers":
        def zeros(*shape):
            return torch.zeros(shape, dtype=torch.int64, device=device)

        window = (zeros(max_batch), zeros(max_batch, max_blocks)) if window_tables else (None, None)
        return cls(zeros(max_batch), zeros(max_batch), zeros(max_batch), zeros(max_batch, max_blocks), zeros(max_batch),
                   zeros(0), *window)

    def load(self, batch: FlatBatch, size: int, scratch_slot: int) -> None:
        """Copy a decode-only batch of n <= size requests into rows [0, n); rows [n, size) become padding."""
        meta = batch.meta
        n, width = batch.num_decodes, batch.max_blocks
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        # Columns past ``width`` keep older steps' entries; seq_lens bounds every read, so they are never used.
        self.block_table[:n, :width].copy_(meta.decode_block_table, non_blocking=True)
        self.seq_lens[:n].copy_(meta.decode_seq_lens, non_blocking=True)
        if self.window_slot_mapping is not None:
            self.window_slot_mapping[:n].copy_(meta.windowed.slot_mapping, non_blocking=True)
            self.window_block_table[:n, :width].copy_(meta.windowed.decode_block_table, non_blocking=True)
        self.pad(n, size, scratch_slot)

    def pad(self, start: int, end: int, scratch_slot: int) -> None:
        self.input_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.slot_mapping[start:end].fill_(scratch_slot)
        self.seq_lens[start:end].zero_()
        if self.window_slot_mapping is not None:
            self.window_slot_mapping[start:end].fill_(scratch_slot)

    def metadata(self, size: int, splits: int, sliding_window: int) -> TritonAttentionMetadata:
        """Metadata over the first ``size`` rows (views: a graph captured with it reads later contents)."""
        meta = TritonAttentionMetadata(
            slot_mapping=self.slot_mapping[:size], num_decodes=size,
            decode_block_table=self.block_table[:size], decode_seq_lens=self.seq_lens[:size], decode_splits=splits,
            num_prefills=0, prefill_block_table=self.empty.view(0, 1), prefill_seq_lens=self.empty,
            prefill_query_start=self.empty, prefill_query_len=self.empty, prefill_tile_req=self.empty,
            prefill_tile_start=self.empty, sliding_window=sliding_window,
        )
        if self.window_slot_mapping is not None:
            meta.windowed = replace(meta, slot_mapping=self.window_slot_mapping[:size],
                                    decode_block_table=self.window_block_table[:size])
        return meta


class DecodeGraphs:
    """One captured forward per batch size; ``run`` replays the smallest that fits a decode-only batch."""

    def __init__(self, model: torch.nn.Module, sizes: tuple[int, ...], max_blocks: int, device: torch.device,
                 num_kv_heads: int, sliding_window: int, scratch_slot: int, capture: bool,
                 window_tables: bool = False) -> None:
        """``window_tables``: the sliding-window layers have their own block tables (two cache groups)."""
        if capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.sizes = tuple(sorted(set(sizes)))
        self.max_blocks = max_blocks
        self.scratch_slot = scratch_slot
        self.capture = capture
        self.buffers = StaticDecodeBuffers.allocate(self.sizes[-1], max_blocks, device, window_tables)
        self.metas = {b: self.buffers.metadata(b, decode_splits(b, num_kv_heads, device), sliding_window) for b in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # [B, H] each, written by its graph's replay
        self.replays = 0  # steps served from the buffers (graph replays, or eager runs when not capturing)
        self.real_rows = RealRows(model, device)  # what the expert-load counters count of the padded rows

    def _forward(self, size: int) -> torch.Tensor:
        b = self.buffers
        with self.real_rows.counted():
            return self.model(b.input_ids[:size], b.positions[:size], self.metas[size])

    @torch.inference_mode()
    def warm_up(self, size: int) -> None:
        """One forward of ``size`` rows, all padding: it writes only the scratch block and counts no expert load."""
        self.buffers.pad(0, size, self.scratch_slot)
        self.real_rows.set(0)
        self._forward(size)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size, largest first so the smaller graphs reuse its memory pool."""
        pool = None
        for size in reversed(self.sizes):
            self.warm_up(size)  # compiles the Triton kernels and warms the allocator outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def covers(self, batch: FlatBatch) -> bool:
        """Decode-only batches of the Triton path that fit the largest size and the buffers' width."""
        meta = batch.meta
        return (
            isinstance(meta, TritonAttentionMetadata) and meta.num_prefills == 0
            and 0 < batch.num_decodes <= self.sizes[-1] and batch.max_blocks <= self.max_blocks
        )

    def run(self, batch: FlatBatch) -> torch.Tensor:
        """hidden [n, H] of a covered batch."""
        n = batch.num_decodes
        size = pick_batch_size(n, self.sizes)
        self.buffers.load(batch, size, self.scratch_slot)
        self.real_rows.set(n)
        self.replays += 1
        if self.capture:
            self.graphs[size].replay()
            return self.outputs[size][:n]
        return self._forward(size)[:n]


def build_decode_graphs(model, cache_config: CacheConfig, attention_backend: str, device, sizes: tuple[int, ...] | None,
                        max_num_seqs: int, max_model_len: int, capture: bool = True) -> DecodeGraphs:
    """Decode graphs over ``model`` and its KV caches (bound already: ``cache_config``'s pool plus the scratch
    block; its sliding window says whether the window layers keep their own block tables), captured with
    ``capture``; the engine builds them before its runner (``engine.ranks.rank_builder``)."""
    if attention_backend != "triton":
        raise ValueError("CUDA graphs need the Triton attention kernels")
    sizes = tuple(s for s in (sizes or default_batch_sizes(max_num_seqs)))
    block_size = cache_config.block_size
    graphs = DecodeGraphs(model, sizes, -(-max_model_len // block_size), device, model.num_local_kv_heads,
                          model.config.sliding_window or 0, cache_config.num_blocks * block_size, capture,
                          window_tables=cache_config.sliding_window is not None)
    if capture:
        graphs.capture_all()
        logger.info("captured decode CUDA graphs for batch sizes %s", graphs.sizes)
    return graphs


def enable_decode_graphs(runner, sizes: tuple[int, ...] | None, max_num_seqs: int, max_model_len: int,
                         capture: bool = True) -> DecodeGraphs:
    """Decode graphs for a built ``runner``, its steps routed through them: for tests and benchmarks that run one
    engine's steps with and without them."""
    # The runner's pool as the graphs read it: its size (the scratch block follows it) and whether the window
    # layers keep their own block tables (any window stands for it).
    pool = CacheConfig(runner.block_size, runner.scratch_block, False, 1 if runner.window_tables else None)
    graphs = build_decode_graphs(runner.model, pool, runner.attention_backend, runner.device, sizes, max_num_seqs,
                                 max_model_len, capture)
    runner.set_graphs(graphs, runner.piecewise_graphs)
    return graphs
