"""Timing a kernel call: CUDA-graph capture and median wall time. Used at start-up by the engine's
kernel selection (``engine.transforms.gemv_select``) and by the benchmarks and tuning scripts."""

import statistics
import time

import torch


def capture_graph(fn, device: torch.device):
    """``fn`` captured into a CUDA graph (after one eager warm-up call), or None off CUDA or if capture fails.

    Timing replays leaves out the host's launch gaps, as the engine's decode
    graphs do; at decode sizes those gaps are longer than the kernels.
    """
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(stream):
            fn()  # compile / autotune outside the capture
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError:
        torch.cuda.synchronize(device)
        return None
    return graph


def median_ms(fn, device: torch.device, reps: int, warmup: int, flush: torch.Tensor | None = None) -> float:
    """Median wall time of ``fn()`` in milliseconds: CUDA events on a GPU, perf_counter on the CPU.

    ``flush`` (a large buffer) is read before each timed call, outside the
    timed region, so weights come from memory and not from L2. Read, not
    zeroed: a zeroing pass leaves L2 full of dirty lines whose write-back
    would land inside the timed call and bill a memory-bound kernel for
    traffic that is not its own.
    """
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize(device)
    events = []
    for _ in range(reps):
        if flush is not None:
            flush.max()  # a reduction: reads every byte, writes one scalar
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in events)
