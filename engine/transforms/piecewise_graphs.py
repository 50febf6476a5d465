"""Piecewise CUDA graphs for steps the decode graphs do not cover: prefill chunks and mixed steps.

Legend: T a captured token count, n the step's tokens (n <= T), L layers, H hidden, h query heads,
kvh KV heads, d head dim.

A step of n tokens is padded up to the smallest captured token count T. The forward is cut at every
attention core (KV write + paged attention), whose metadata and shapes change with every step; the
L + 1 pieces between the cores are fixed-shape per token and are captured once per T:

    piece 0:      embedding, layer 0's input norm, qkv projection, q/k norms, RoPE
    piece i:      layer i-1's o_proj, residual, norm, router and MoE; layer i's input norm ... RoPE
    piece L:      layer L-1's o_proj ... MoE, the final norm

A step replays piece 0, runs layer 0's attention core eagerly on the n real rows with the step's own
metadata, replays piece 1, and so on: L + 1 replays and L eager cores instead of every kernel launched
from Python. The pieces talk through static buffers (q, k, v, the residual sum, the attention output):
each piece copies its results into them, so the pieces' intermediates live only inside their capture
and every graph shares one memory pool.

Padding rows [n, T) are inert: token 0 at position 0, and the attention core never sees them (their
K/V is not written; their attention output is whatever an earlier step left there, finite). Every
captured operation is per row, so they cannot change the real rows. Their MoE routing is real work on
garbage tokens, which the layers' expert-load counters leave out (rows [0, n) only, ``engine.transforms.real_rows``;
the warm-up runs before the captures count nothing), as with the decode graphs.

The attention core runs outside the graphs, so either attention backend works. The captured MoE must
be graph-safe: the Triton fused kernels are (routing, sorting and the grouped GEMMs never read the
device from the host); the torch backend reads its per-expert counts on the host and is refused.
``capture=False`` runs the same padding, static-buffer and piece code eagerly: that is how the CPU
tests exercise everything here but the capture itself.
"""

import logging
import time

import torch

from engine.layers.moe import SparseMoeBlock
from engine.transforms.cuda_graphs import pick_batch_size
from engine.device_batch.flat_batch import FlatBatch
from engine.transforms.real_rows import RealRows

logger = logging.getLogger(__name__)

# Larger steps stay eager by default: each captured size costs start-up time, and a step's matrix work grows
# with its tokens while its launches do not (an 8192-token prefill ran at 2.85x its floor eagerly on an H100).
DEFAULT_LARGEST_TOKEN_SIZE = 512


def default_token_sizes(max_num_batched_tokens: int) -> tuple[int, ...]:
    """16, 32, 64, ... 512, each at most ``max_num_batched_tokens`` (which is added when smaller than 512)."""
    largest = min(max_num_batched_tokens, DEFAULT_LARGEST_TOKEN_SIZE)
    sizes = {s for s in (16, 32, 64, 128, 256, 512) if s <= largest}
    sizes.add(largest)
    return tuple(sorted(sizes))


class StaticStepBuffers:
    """What the pieces read and write, sized for the largest captured token count."""

    def __init__(self, max_tokens: int, hidden: int, project_shapes: tuple[tuple[int, ...], ...],
                 attend_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        def zeros(*shape, dtype=dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = zeros(max_tokens, dtype=torch.int64)  # [T_max]
        self.positions = zeros(max_tokens, dtype=torch.int64)  # [T_max]
        # What the attention layers' ``project`` hands their ``attend``, per token: q [h, d], k and v [kvh, d] for
        # standard attention; q [h, n + p], the latent [r] and the rope key [p] for MLA.
        self.q, self.k, self.v = (zeros(max_tokens, *shape) for shape in project_shapes)
        self.residual = zeros(max_tokens, hidden)  # [T_max, H]: the running residual sum between pieces
        self.attn = zeros(max_tokens, *attend_shape)  # [T_max, h, d]: the attention cores' output
        self.out = zeros(max_tokens, hidden)  # [T_max, H]: the final norm's output

    def load(self, batch: FlatBatch, size: int) -> None:
        """The step's n tokens into rows [0, n); rows [n, size) become padding (token 0 at position 0)."""
        n = batch.input_ids.shape[0]
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()


class PiecewiseGraphs:
    """The forward as L + 1 pieces per captured token count; ``run`` pads a step to the smallest that fits."""

    def __init__(self, model: torch.nn.Module, sizes: tuple[int, ...], device: torch.device, capture: bool) -> None:
        if capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.layers = list(model.model.layers)
        self.sizes = tuple(sorted(set(sizes)))
        self.capture = capture
        attn = self.layers[0].self_attn
        self.buffers = StaticStepBuffers(self.sizes[-1], model.config.hidden_size, attn.project_shapes(),
                                         attn.attend_shape(), model.model.embed_tokens.weight.dtype, device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}  # T -> its L + 1 pieces
        self.replays = 0  # steps served from the buffers (graph replays, or eager pieces when not capturing)
        self.capture_s = 0.0  # start-up time spent capturing (warm-ups included)
        self.capture_mib = 0.0  # device memory the capture reserved (its graphs' pool and workspaces)
        self.real_rows = RealRows(model, device)  # what the expert-load counters count of the padded rows

    @property
    def num_pieces(self) -> int:
        return len(self.layers) + 1

    def _piece(self, i: int, size: int) -> None:
        """Piece ``i`` over rows [0, size) of the buffers (see the module docstring for what each holds)."""
        with self.real_rows.counted():
            self._piece_rows(i, size)

    def _piece_rows(self, i: int, size: int) -> None:
        b = self.buffers
        positions = b.positions[:size]
        if i == 0:
            x, residual = self.model.model.embed_tokens(b.input_ids[:size]), None  # [T, H]
        else:
            x, residual = self.layers[i - 1].post_attention(b.attn[:size], b.residual[:size])
        if i == len(self.layers):
            b.out[:size].copy_(self.model.model.norm(x, residual)[0])
            return
        q, k, v, residual = self.layers[i].pre_attention(x, residual, positions)
        # Copied out so the piece's own tensors die with its capture (one shared pool, not one per piece).
        b.q[:size].copy_(q)
        b.k[:size].copy_(k)
        b.v[:size].copy_(v)
        b.residual[:size].copy_(residual)

    @torch.inference_mode()
    def warm_up(self, i: int, size: int) -> None:
        """Piece ``i`` once over ``size`` rows of padding (token 0 at position 0), counting no expert load."""
        self.buffers.input_ids[:size].zero_()
        self.buffers.positions[:size].zero_()
        self.real_rows.set(0)
        self._piece(i, size)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every token count's pieces, largest first; logs the time and memory it took."""
        start = time.perf_counter()
        before = torch.cuda.memory_reserved()
        pool = None
        for size in reversed(self.sizes):
            pieces = []
            for i in range(self.num_pieces):
                self.warm_up(i, size)  # compiles the Triton kernels for this shape and warms the allocator
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._piece(i, size)
                pool = graph.pool()
                pieces.append(graph)
            self.graphs[size] = pieces
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - start
        self.capture_mib = (torch.cuda.memory_reserved() - before) / 2**20
        logger.info("captured piecewise CUDA graphs (%d pieces) for token counts %s in %.1f s, %.0f MiB",
                    self.num_pieces, self.sizes, self.capture_s, self.capture_mib)

    def covers(self, batch: FlatBatch) -> bool:
        return 0 < batch.input_ids.shape[0] <= self.sizes[-1]

    def run(self, batch: FlatBatch) -> torch.Tensor:
        """hidden [n, H] of a covered batch: the pieces (replayed or eager) with the attention cores between."""
        n = batch.input_ids.shape[0]
        size = pick_batch_size(n, self.sizes)
        b = self.buffers
        b.load(batch, size)
        self.real_rows.set(n)
        self.replays += 1
        for i in range(self.num_pieces):
            if self.capture:
                self.graphs[size][i].replay()
            else:
                self._piece(i, size)
            if i < len(self.layers):  # the core on the real rows only: padding writes no K/V
                b.attn[:n].copy_(self.layers[i].self_attn.attend(b.q[:n], b.k[:n], b.v[:n], batch.meta))
        return b.out[:n]


def layers_share_buffers(model) -> bool:
    """Whether every local layer's attention hands the same per-token shapes from ``project`` to ``attend`` (and
    returns the same): the pieces' static buffers have one shape. Not so where layer kinds differ in query or KV
    heads (Step-3.7-Flash's sliding layers, MiMo-V2-Flash's): such models run prefill steps eagerly."""
    shapes = {(layer.self_attn.project_shapes(), layer.self_attn.attend_shape()) for layer in model.local_layers()}
    return len(shapes) <= 1


def build_piecewise_graphs(model, device, sizes: tuple[int, ...], capture: bool = True) -> PiecewiseGraphs:
    """Piecewise graphs over ``model`` (its KV caches bound already), captured with ``capture``; the engine
    builds them before its runner (``engine.ranks.rank_builder``)."""
    if model.tp.size > 1 or model.tp.expert_parallel is not None:
        raise ValueError("piecewise CUDA graphs would replay one rank's collectives alone: they need a single rank")
    # "auto" is Triton on CUDA, which capturing needs anyway.
    if capture and any(m.backend not in ("triton", "auto") for m in model.modules() if isinstance(m, SparseMoeBlock)):
        raise ValueError("piecewise CUDA graphs need the Triton MoE kernels: the torch MoE path reads its "
                         "per-expert counts on the host, which a capture forbids")
    if not sizes:
        raise ValueError("piecewise CUDA graphs need at least one token count")
    if not layers_share_buffers(model):
        raise ValueError("piecewise CUDA graphs need every layer's attention to take and give the same shapes")
    graphs = PiecewiseGraphs(model, sizes, device, capture)
    if capture:
        graphs.capture_all()
    return graphs


def enable_piecewise_graphs(runner, sizes: tuple[int, ...], capture: bool = True) -> PiecewiseGraphs:
    """Piecewise graphs for a built ``runner``, its steps routed through them: for tests and benchmarks that run
    one engine's steps with and without them."""
    graphs = build_piecewise_graphs(runner.model, runner.device, sizes, capture)
    runner.set_graphs(runner.decode_graphs, graphs)
    return graphs
