"""Choose, by measurement at engine start, which dense projections run the Triton gemv at which row counts.

Legend: M rows, N out features, K in features, S K-splits.

For each distinct (N, K, dtype, bias) among the model's ``nn.Linear`` modules
and each row bucket (1, 4, 8 rows: a call with M rows uses the smallest bucket
>= M), the selection times ``F.linear`` and every candidate launch at the
bucket's row count, on the model's own weight, as CUDA-graph replays timed by
CUDA events, with L2 flushed by a read before each call (in a decode step
each layer's weights come from memory). The gemv is used for a bucket only if
its best launch beats ``F.linear`` by more than ``MARGIN``; every choice is
logged and returned as a report.

Candidates are data (``FMA_TILES``, ``DOT_TILES``): a handful per bucket, each
tried with one K-split and with enough splits to give the GPU several programs
per SM (splits cost no extra compile). Each tile compiles once per dtype and
bias (shapes of the same divisibility share it), about twenty kernels for a
bf16 model; Triton caches them on disk, so later starts are quick.
"""

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
import triton

from engine.kernels.dense_gemv import MAX_GEMV_ROWS, GemvConfig, dense_gemv
from engine.layers.gemv_linear import LinearShape, RowLaunches, enable_dense_gemv, linear_modules

logger = logging.getLogger(__name__)

ROW_BUCKETS = (1, 4, 8)  # row tiles: the decode CUDA-graph sizes up to MAX_GEMV_ROWS share three kernels
assert ROW_BUCKETS[-1] == MAX_GEMV_ROWS
MARGIN = 0.02  # the gemv must be at least 2% faster: a tie (timing noise) keeps cuBLAS
PROGRAMS_PER_SM = 4  # K-splits aim for this many programs per SM, to keep enough bytes of W in flight

# FMA path tiles per row bucket: (BLOCK_N, BLOCK_K, num_warps, num_stages). Each holds 32 or 64 float32
# partials per thread (bucket * BLOCK_N * BLOCK_K / (32 * warps); more would spill registers), so a program
# reads 8-32 KiB of bf16 W per step at one row and 2-8 KiB at 4-8 rows, with 16-byte loads along K; bytes
# in flight come from several programs per SM (and the K-splits). Compiled for sm_90 (Triton 3.9, bf16):
# 64 partials take ~145 registers a thread at one row (3 programs of 4 warps per SM), 32 take ~80 (6).
# Triton does not software-pipeline these loads (they feed no tl.dot), so num_stages changes nothing here.
FMA_TILES = {
    1: ((16, 512, 4, 2), (32, 256, 4, 2), (16, 256, 4, 2), (32, 256, 8, 2), (32, 512, 8, 2), (64, 256, 8, 2)),
    4: ((8, 256, 4, 2), (16, 128, 4, 2), (16, 256, 8, 2), (32, 128, 8, 2)),
    8: ((8, 128, 4, 2), (8, 256, 8, 2), (16, 128, 8, 2)),
}
# Tensor-core path (rows padded to 16), for the buckets past one row: Triton pipelines its W tiles
# through shared memory num_stages deep (cp.async in the sm_90 build).
DOT_TILES = ((32, 128, 4, 4), (64, 128, 4, 4), (32, 256, 4, 3), (64, 256, 8, 3))
# Under the CPU interpreter ("on" in tests): small tiles, so K-splits and masks get exercised.
INTERPRETER_TILE = (32, 32, 4, 1)


def occupancy_split(n: int, k: int, block_n: int, block_k: int, num_sms: int) -> int:
    """K-splits that bring cdiv(N, BLOCK_N) column blocks up to PROGRAMS_PER_SM programs per SM.

    Each split keeps at least one BLOCK_K tile, and there are at most 16 (the float32 partials grow with them).
    """
    blocks = triton.cdiv(n, block_n)
    wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms, blocks)
    return max(1, min(wanted, triton.cdiv(k, block_k), 16))


def candidates(shape: LinearShape, bucket: int, num_sms: int) -> list[GemvConfig]:
    """Every launch timed for ``shape`` at ``bucket`` rows."""
    tiles = [(bucket, t, False) for t in FMA_TILES[bucket]]
    if bucket > 1:
        tiles += [(max(16, bucket), t, True) for t in DOT_TILES]
    out = []
    for block_m, (bn, bk, warps, stages), dot in tiles:
        for split in sorted({1, occupancy_split(shape.n, shape.k, bn, bk, num_sms)}):
            out.append(GemvConfig(block_m, bn, bk, warps, stages, dot, split))
    return out


def forced_config(shape: LinearShape, bucket: int, num_sms: int, interpreter: bool) -> GemvConfig:
    """The launch ``dense_gemv="on"`` uses without measuring: a middle FMA tile (a small one on the interpreter)."""
    bn, bk, warps, stages = INTERPRETER_TILE if interpreter else FMA_TILES[bucket][1]
    return GemvConfig(bucket, bn, bk, warps, stages, False, occupancy_split(shape.n, shape.k, bn, bk, num_sms))


@dataclass(slots=True)
class BucketChoice:
    """One (shape, row bucket) measurement: F.linear's time, the best gemv launch's, and which is used."""

    rows: int
    linear_us: float | None
    gemv_us: float | None
    config: GemvConfig | None  # the best launch measured (or the forced one)
    use_gemv: bool
    tried: list[tuple[str, float | None]] = field(default_factory=list)  # (launch, us or None: failed) per candidate


@dataclass(slots=True)
class ShapeChoice:
    """The choices for one (N, K, dtype, bias): one ``BucketChoice`` per row bucket, and the launches they make."""

    shape: LinearShape
    modules: list[str]  # qualified names (the first few) of the modules of this shape
    count: int
    buckets: list[BucketChoice] = field(default_factory=list)

    def launches(self) -> RowLaunches:
        """Launch per row count 0..MAX_GEMV_ROWS: the config of the smallest bucket >= M, if that bucket uses the gemv."""
        launches: list[GemvConfig | None] = [None]
        for rows in range(1, MAX_GEMV_ROWS + 1):
            choice = next(b for b in self.buckets if b.rows >= rows)
            launches.append(choice.config if choice.use_gemv else None)
        return tuple(launches)

    def to_dict(self) -> dict:
        return dict(
            shape=str(self.shape), n=self.shape.n, k=self.shape.k, dtype=str(self.shape.dtype).removeprefix("torch."),
            bias=self.shape.bias, modules=self.modules, count=self.count,
            buckets=[dict(rows=b.rows, linear_us=b.linear_us, gemv_us=b.gemv_us, use_gemv=b.use_gemv,
                          config=b.config.short() if b.config else None, tried=b.tried) for b in self.buckets],
        )


# timer(weight, bias, rows, cfg) -> ms of one call at ``rows`` rows; cfg None times F.linear.
Timer = Callable[[torch.Tensor, torch.Tensor | None, int, GemvConfig | None], float]


class ReplayTimer:
    """Median ms of CUDA-graph replays (CUDA events) with L2 flushed by a read before each, on the given weights.

    Off CUDA (the benchmark's smoke run) it times eager calls with ``time.perf_counter`` and flushes nothing.
    """

    def __init__(self, device: torch.device, reps: int = 10, warmup: int = 2, flush_bytes: int = 256 << 20) -> None:
        self.device, self.reps, self.warmup = device, reps, warmup
        self.flush = torch.ones(flush_bytes, dtype=torch.uint8, device=device) if device.type == "cuda" else None

    def __call__(self, weight, bias, rows, cfg) -> float:
        from moe_kernels.timing import capture_graph, median_ms

        x = torch.randn(rows, weight.shape[1], device=self.device, dtype=weight.dtype)  # [M, K]
        # Both as the model calls them, output allocation included.
        if cfg is None:
            fn = lambda: F.linear(x, weight, bias)  # noqa: E731
        else:
            fn = lambda: dense_gemv(x, weight, bias, cfg)  # noqa: E731
        graph = capture_graph(fn, self.device)
        return median_ms(graph.replay if graph is not None else fn, self.device, self.reps, self.warmup, self.flush)


def select(shapes: dict[LinearShape, list[tuple[str, torch.nn.Linear]]], timer: Timer, num_sms: int) -> list[ShapeChoice]:
    """Measure every shape at every row bucket; the gemv wins a bucket only if faster than F.linear by MARGIN."""
    choices = []
    for shape, mods in shapes.items():
        linear = mods[0][1]
        choice = ShapeChoice(shape, [name for name, _ in mods[:3]], len(mods))
        for bucket in ROW_BUCKETS:
            linear_ms = timer(linear.weight, linear.bias, bucket, None)
            best_ms, best_cfg, tried = float("inf"), None, []
            for cfg in candidates(shape, bucket, num_sms):
                try:
                    ms = timer(linear.weight, linear.bias, bucket, cfg)
                except Exception as e:  # noqa: BLE001 out of registers/shared memory on this GPU: not a candidate
                    logger.debug("dense gemv %s %s failed: %s", shape, cfg.short(), e)
                    tried.append((cfg.short(), None))
                    continue
                tried.append((cfg.short(), round(ms * 1e3, 2)))
                if ms < best_ms:
                    best_ms, best_cfg = ms, cfg
            use = best_cfg is not None and best_ms < linear_ms * (1 - MARGIN)
            choice.buckets.append(BucketChoice(bucket, linear_ms * 1e3, best_ms * 1e3 if best_cfg else None, best_cfg, use,
                                               tried))
        choices.append(choice)
    return choices


def forced(shapes: dict[LinearShape, list[tuple[str, torch.nn.Linear]]], num_sms: int, interpreter: bool) -> list[ShapeChoice]:
    """``dense_gemv="on"``: every shape at every bucket, with ``forced_config``, unmeasured."""
    choices = []
    for shape, mods in shapes.items():
        choice = ShapeChoice(shape, [name for name, _ in mods[:3]], len(mods))
        for bucket in ROW_BUCKETS:
            choice.buckets.append(BucketChoice(bucket, None, None, forced_config(shape, bucket, num_sms, interpreter), True))
        choices.append(choice)
    return choices


def format_choices(choices: list[ShapeChoice]) -> str:
    """One line per (shape, bucket): times and weight-read GB/s of both paths, the launch, and which path runs."""
    lines = [f"{'shape (K->N dtype)':<28} {'modules':>7} {'rows':>4} {'F.linear us':>11} {'GB/s':>6} {'gemv us':>8} "
             f"{'GB/s':>6} {'speed-up':>8}  {'uses':<8} best gemv launch"]
    for c in choices:
        weight_bytes = c.shape.n * c.shape.k * torch.empty(0, dtype=c.shape.dtype).element_size()

        def cols(us):
            return (f"{us:.1f}", f"{weight_bytes / (us * 1e3):.0f}") if us else ("-", "-")

        for b in c.buckets:
            (lin, lin_gbs), (gemv, gemv_gbs) = cols(b.linear_us), cols(b.gemv_us)
            ratio = f"{b.linear_us / b.gemv_us:.2f}x" if b.linear_us and b.gemv_us else "-"
            lines.append(f"{str(c.shape):<28} {c.count:>7} {b.rows:>4} {lin:>11} {lin_gbs:>6} {gemv:>8} {gemv_gbs:>6} "
                         f"{ratio:>8}  {'gemv' if b.use_gemv else 'F.linear':<8} {b.config.short() if b.config else '-'}")
    return "\n".join(lines)


def group_by_shape(model: torch.nn.Module) -> dict[LinearShape, list[tuple[str, torch.nn.Linear]]]:
    shapes: dict[LinearShape, list[tuple[str, torch.nn.Linear]]] = {}
    for name, linear in linear_modules(model):
        shapes.setdefault(LinearShape.of(linear), []).append((name, linear))
    return shapes


def apply_dense_gemv(model: torch.nn.Module, device: torch.device, mode: str, timer: Timer | None = None) -> list[ShapeChoice]:
    """Measure (``mode`` "measure") or force (``mode`` "on") the gemv launches and swap the model's Linears.

    Returns the choices (also logged). "measure" needs CUDA unless a ``timer`` is given (tests).
    """
    assert mode in ("measure", "on"), mode
    from engine.kernels.dense_gemv import interpreted

    shapes = group_by_shape(model)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    start = time.perf_counter()
    if mode == "on":
        choices = forced(shapes, num_sms, interpreted())
    else:
        own_timer = timer is None
        timer = timer or ReplayTimer(device)
        with torch.inference_mode():
            choices = select(shapes, timer, num_sms)
        if own_timer:
            del timer
            torch.cuda.empty_cache()  # the flush buffer: give it back before the KV pool is sized
    swapped = enable_dense_gemv(model, {c.shape: c.launches() for c in choices})
    logger.info("dense gemv (%s, %.1f s): %d of %d Linear modules switched\n%s", mode, time.perf_counter() - start,
                swapped, sum(c.count for c in choices), format_choices(choices))
    return choices
