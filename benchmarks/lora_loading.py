"""Step times while LoRA adapters are loaded into device slots vs with every adapter resident.

    python -m benchmarks.lora_loading [--adapters 8] [--max-loras 2] [--rank 16] [--rounds 3]

A random small Qwen3-MoE checkpoint and ``--adapters`` PEFT-format adapters (``benchmarks.lora_throughput``'s).
The same workload runs on two engines: "loading" has ``--max-loras`` slots and as many host copies
(``max_cpu_loras``), so every adapter that comes back is read from disk in the background and written into a
slot between steps; "resident" has a slot for every adapter (nothing is loaded after start). Workload:
``--long`` base-model requests decode throughout; every ``--every`` steps a short request arrives under the next
adapter (cycling). Each step's wall time is recorded; "decode steps" are those without prefill tokens. After one
unrecorded pass per engine (warm-up), reported per engine (median over rounds, alternating which runs first): p50 and max decode step, max / p50 (goal: at most
1.5x while adapters are loaded), and the steps that carried a slot write. CPU, float32.

Then, per round, what the long decode steps had in them: max / p50, p50 of the decode steps during which a
background adapter read was in flight vs of the others, garbage-collection time and slot-write time inside
decode steps.
"""

import argparse
import gc
import random
import statistics
import tempfile
import time

import torch

from benchmarks.lora_throughput import SHAPE, write_base_and_adapters
from engine import LLM, RequestPolicy, SamplingParams
from engine.serving.engine_process import freeze_startup_heap


class GcTimer:
    """Milliseconds spent in garbage collection since ``reset`` (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.ms, self._start = 0.0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.ms += (time.perf_counter() - self._start) * 1e3


GC = GcTimer()


def run(llm: LLM, names: list[str], args) -> dict[str, float]:
    """One pass of the workload; step times in milliseconds by kind."""
    engine = llm.engine
    host = engine.lora.host
    rng = random.Random(0)
    long = SamplingParams(temperature=0, max_tokens=args.arrivals * args.every + 16, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=args.short_tokens, ignore_eos=True)
    for _ in range(args.long):
        engine.add_request([rng.randrange(2, SHAPE["vocab_size"]) for _ in range(16)], long)
    decode_ms, load_ms = [], []
    read_ms, quiet_ms = [], []  # decode steps with a background read in flight (at their start or end), others
    gc_ms = slot_write_ms = 0.0  # inside decode steps
    arrived, step = 0, 0
    before = engine.stats()
    while engine.has_unfinished():
        if step % args.every == 0 and arrived < args.arrivals:
            prompt = [rng.randrange(2, SHAPE["vocab_size"]) for _ in range(args.prompt_len)]
            engine.add_request(prompt, short, policy=RequestPolicy(lora_adapter=names[arrived % len(names)]))
            arrived += 1
        prior = engine.stats()
        reading, read_s, GC.ms = host.reading, host.read_seconds, 0.0
        start = time.perf_counter()
        engine.step()
        ms = (time.perf_counter() - start) * 1e3
        stats = engine.stats()
        if stats.lora_slot_loads > prior.lora_slot_loads:
            load_ms.append(ms)
        if stats.step_prefill_tokens == 0 and stats.step_decode_tokens > 0:
            decode_ms.append(ms)
            (read_ms if reading or host.reading or host.read_seconds != read_s else quiet_ms).append(ms)
            gc_ms += GC.ms
            slot_write_ms += (stats.lora_slot_load_seconds - prior.lora_slot_load_seconds) * 1e3
        step += 1
    after = engine.stats()
    p50 = statistics.median(decode_ms)
    return {"p50": p50, "max": max(decode_ms), "ratio": max(decode_ms) / p50, "steps": len(decode_ms),
            "load_steps": len(load_ms), "load_max": max(load_ms, default=0.0),
            "slot_loads": after.lora_slot_loads - before.lora_slot_loads,
            "disk_reads": after.lora_host_misses - before.lora_host_misses,
            "p50_reading": statistics.median(read_ms) if read_ms else 0.0,
            "p50_quiet": statistics.median(quiet_ms) if quiet_ms else 0.0,
            "max_quiet": max(quiet_ms, default=0.0), "gc_ms": gc_ms, "slot_write_ms": slot_write_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--max-loras", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--long", type=int, default=4, help="base-model requests decoding throughout")
    ap.add_argument("--arrivals", type=int, default=24, help="short adapter requests, one every --every steps")
    ap.add_argument("--every", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--short-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--thread-reads", action="store_true",
                    help="a third engine that parses adapters on a thread of its own process (the GIL's cost)")
    ap.add_argument("--no-gc-freeze", action="store_true", help="leave the startup heap to the garbage collector")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        names = write_base_and_adapters(tmp, args.adapters, args.rank)
        common = dict(model=f"{tmp}/base", dtype="float32", device="cpu", num_kv_blocks=1024, block_size=16,
                      lora_adapters=",".join(f"{n}={tmp}/{n}" for n in names), max_lora_rank=args.rank,
                      overlap_scheduling=False)
        engines = {"loading": LLM(**common, max_loras=args.max_loras, max_cpu_loras=args.max_loras),
                   "resident": LLM(**common, max_loras=args.adapters)}
        if args.thread_reads:
            thread = LLM(**common, max_loras=args.max_loras, max_cpu_loras=args.max_loras)
            lora = thread.engine.lora
            lora.host._background = lora.read  # the parse on the host cache's thread, as before the reader process
            engines["loading-thread"] = thread
        if not args.no_gc_freeze:
            freeze_startup_heap()  # as a served engine's process does once its engine is built
        try:
            compare(engines, names, args)
        finally:
            gc.unfreeze()


def compare(engines: dict[str, LLM], names: list[str], args) -> None:
    """The rounds, alternating which engine runs first, and the report."""
    results: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    for llm in engines.values():  # warm-up, not recorded: first-touch costs, and the reader process's start
        run(llm, names, args)
    for r in range(args.rounds):
        order = list(engines)
        for name in (order if r % 2 == 0 else order[::-1]):
            results[name].append(run(engines[name], names, args))
    print(f"{args.adapters} adapters of rank {args.rank}, {args.long} base-model requests decoding, "
          f"{args.arrivals} adapter requests one every {args.every} steps; {args.rounds} rounds, "
          f"{args.threads} thread(s); median [min, max] over rounds")
    for name, rounds in results.items():
        def col(key):
            values = [x[key] for x in rounds]
            return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"
        slots = args.adapters if name == "resident" else args.max_loras
        print(f"  {name:14s} (max_loras {slots}): decode step p50 {col('p50')} ms, max {col('max')} ms, "
              f"max/p50 {col('ratio')} (goal <= 1.5); steps with a slot write: {col('load_steps')}, their "
              f"max {col('load_max')} ms; disk reads {col('disk_reads')}")
    print("per round (run order alternates): max/p50 | decode steps with a read in flight p50, without p50 (max) | "
          "GC and slot-write ms inside decode steps")
    for r in range(args.rounds):
        print(f"  round {r}: " + "; ".join(
            f"{name} {x['ratio']:.2f} | {x['p50_reading']:.1f}, {x['p50_quiet']:.1f} ({x['max_quiet']:.1f}) ms | "
            f"{x['gc_ms']:.1f}, {x['slot_write_ms']:.1f}" for name, x in ((n, results[n][r]) for n in results)))


if __name__ == "__main__":
    main()
