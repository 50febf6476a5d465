"""What another process's CPU costs the CPU engine: offline throughput alone vs beside a "waker".

    python -m benchmarks.cpu_interference [--period-ms 3,30] [--busy-pct 4] [--pairs 6]
                                          [--nice 0,19] [--touch-mb 0,16] [--pin]

The waker is a second process that sleeps ``period`` ms, then spins for
``busy-pct`` percent of that period, over and over: about the shape of a
gateway's work beside a batch (short bursts when results arrive), with nothing
else of the gateway. The engine is ``engine.LLM`` on the demo model with every
core for torch, running the same 320 requests (16 output tokens) again and
again; each pair runs "alone" and "beside the waker" back to back, in
alternating order, and the ratio of the medians is printed.

Why it exists: the Batch API's goal 2 compares a served batch with the offline
engine, and on a machine with as many torch threads as cores a parallel region
waits at its barrier for a thread the waker took, so the engine can lose more
than the waker's own CPU. This measures by how much, with no gateway, database
or HTTP involved.
"""

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time

from benchmarks.batch_goals import _requests, pin_split


def _waker(period_s: float, busy_s: float, nice: int, touch_mb: float, cores: set[int] | None, stop) -> None:
    if nice:
        os.nice(nice)
    if cores:
        os.sched_setaffinity(0, cores)
    buffer = None
    if touch_mb:
        import numpy

        buffer = numpy.ones(int(touch_mb * 2**20 / 8))  # float64
    while not stop.is_set():
        time.sleep(period_s)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < busy_s:
            if buffer is not None:
                buffer.sum()  # streams the buffer through the caches the engine's weights live in


def _prompts(n: int, seed: int) -> list[str]:
    """The Batch API benchmark's prompts (8-48 words), so both measure the same work."""
    return [body["prompt"] for body in _requests(n, seed, 16)]


def measure(llm, period_ms: float, busy_pct: float, pairs: int, requests: int, nice: int = 0, touch_mb: float = 0,
            waker_cores: set[int] | None = None) -> dict:
    """Output tokens/s of ``llm`` alone and beside a waker, ``pairs`` times each, alternating."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    period_s, busy_s = period_ms / 1e3, period_ms / 1e3 * busy_pct / 100
    tok_s = {"alone": [], "beside": []}
    for i in range(pairs):
        for j, mode in enumerate(("alone", "beside") if i % 2 == 0 else ("beside", "alone")):
            # Fresh prompts every run: with the same ones the prefix cache would turn every run after
            # the first into decode only.
            prompts = _prompts(requests, seed=1000 + 2 * i + j)
            stop, waker = multiprocessing.Event(), None
            if mode == "beside":
                waker = multiprocessing.Process(target=_waker, daemon=True,
                                                args=(period_s, busy_s, nice, touch_mb, waker_cores, stop))
                waker.start()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            wall = time.perf_counter() - t0
            if waker is not None:
                stop.set()
                waker.join()
            tok_s[mode].append(sum(len(o.token_ids) for o in outs) / wall)
    alone, beside = statistics.median(tok_s["alone"]), statistics.median(tok_s["beside"])
    loss = 1 - beside / alone
    return {"period_ms": period_ms, "busy_pct_of_one_core": busy_pct, "nice": nice, "touch_mb": touch_mb,
            "alone_tok_s": tok_s["alone"], "beside_tok_s": tok_s["beside"], "ratio": beside / alone,
            "loss_per_busy_pct": loss * 100 / busy_pct}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--period-ms", default="3,30", help="comma-separated waker periods")
    p.add_argument("--busy-pct", type=float, default=4.0, help="the waker's CPU, percent of one core")
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--nice", default="0", help="comma-separated nice values for the waker, each measured")
    p.add_argument("--touch-mb", default="0",
                   help="comma-separated sizes: each burst also reads a buffer of this many MiB (0: a bare spin)")
    p.add_argument("--pin", action="store_true",
                   help="the waker on the first core, the engine on the others with a torch thread per core "
                        "(so they share caches and memory, not cores)")
    p.add_argument("--requests", type=int, default=320)
    p.add_argument("--max-num-seqs", type=int, default=32)
    args = p.parse_args()

    from engine import LLM, SamplingParams
    from engine.loading.demo_model import write_demo_model

    with tempfile.TemporaryDirectory() as model_dir:
        write_demo_model(model_dir, seed=0)
        waker_cores = engine_cores = None
        if args.pin:
            waker_cores, engine_cores = pin_split()
            os.sched_setaffinity(0, engine_cores)  # before torch starts its threads: they inherit it
        llm = LLM(model=model_dir, max_num_seqs=args.max_num_seqs,
                  cpu_threads=len(engine_cores) if engine_cores else None)
        llm.generate(_prompts(2 * args.max_num_seqs, seed=2), SamplingParams(max_tokens=16, ignore_eos=True))  # warm-up
        cases = [(float(p), int(n), float(t)) for p in args.period_ms.split(",") for n in args.nice.split(",")
                 for t in args.touch_mb.split(",")]
        for period, nice, touch_mb in cases:
            r = measure(llm, period, args.busy_pct, args.pairs, args.requests, nice, touch_mb, waker_cores)
            print(f"waker every {period:g} ms, {args.busy_pct:g}% of a core, nice {nice}, reading {touch_mb:g} MiB"
                  f"{', pinned' if args.pin else ''}: alone "
                  f"{[round(x) for x in r['alone_tok_s']]} tok/s, beside {[round(x) for x in r['beside_tok_s']]}: "
                  f"ratio of medians {r['ratio']:.2f} ({r['loss_per_busy_pct']:.1f} points lost per point of "
                  f"the waker's CPU)", flush=True)


if __name__ == "__main__":
    main()
