"""Disaggregated prefill and decode against aggregated replicas, side by side in one run:

  2 aggregated replicas (cache-aware router)  |  1 prefill + 1 decode engine

    python -m benchmarks.disaggregation [--streams 8] [--long-tokens 1024] [--burst 2] [--every 3] [--seconds 30]
                                        [--max-batched-tokens 2048] [--prefill-batched-tokens N]
                                        [--prefill-queue-tokens 1024] [--decode-prefill-chunk-tokens 256] [--fault]

The workload: ``--streams`` steady streams (16-token prompts, 96 tokens each, a new one as soon as one ends:
latency-sensitive chat), and every ``--every`` seconds a burst of ``--burst`` long prompts of
``--long-tokens`` tokens asking for 8 tokens each (documents to summarise). Reported: the steady streams' ITL
(time between consecutive deltas of one stream) p50, p99, p99.9 and max, and the long prompts' TTFT p50 and p99.
A prefill step stalls the gaps that span it; ITL p99 shows the stalls only where more than 1% of the gaps span
one, so with whole-prompt steps (``--max-batched-tokens`` as large as the prompts) p99.9 and max show them.

Every engine is a real engine process (``AsyncEngine``) with one torch thread, so both layouts use two
processes; requests go through the gateway's router objects in this process (``ReplicaRouter``,
``DisaggregatedEngines``; no HTTP). The model is the demo model (random-weight Qwen3-MoE layout, about 8M
parameters). At the end every pool must be back to 0 blocks in use (``leaked``). ``--fault`` adds a third
run of 1P+1D whose prefill engine is killed (SIGKILL) halfway, during a burst, and restarted: no request may fail, and no
block may leak.

The 1P+1D layout runs twice: with conditional disaggregation (``--prefill-queue-tokens``, the decode engine
computes a long prompt itself while the prefill engine is busy) and without it (``prefill_queue_tokens`` 0).
For 1P+1D runs, each long prompt's TTFT is broken down (medians): until the decode engine answered which
blocks it lacks, the prefill engine's queue wait, its compute (until its output, the blocks queued for
sending), and from there to the first token (transfer, the decode engine's admission and first step); long
prompts the decode engine computed itself are counted apart.
"""

import argparse
import asyncio
import dataclasses
import json
import os
import random
import signal
import statistics
import tempfile
import time

from engine.core.config import EngineConfig
from engine.core.request_policy import RequestPolicy
from engine.core.sampling_params import SamplingParams
from engine.loading.demo_model import write_demo_model
from engine.serving.async_engine import AsyncEngine
from gateway.disaggregation import DisaggregatedEngines
from gateway.replica_router import ReplicaRouter
from gateway.routing_policy import RouterConfig


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def _run(router, args, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)
    itl: list[float] = []
    ttft: list[float] = []
    phases: list[dict] = []
    stop = time.monotonic() + args.seconds
    ids = iter(range(10**9))

    async def stream_loop(i: int) -> None:
        while time.monotonic() < stop:
            prompt = [rng.randrange(1, vocab) for _ in range(16)]
            last = None
            async for _ in router.generate(prompt, SamplingParams(temperature=0, max_tokens=96, ignore_eos=True),
                                           f"s{i}-{next(ids)}", policy=RequestPolicy(cache_salt=f"t{i}")):
                now = time.monotonic()
                if last is not None:
                    itl.append(now - last)
                last = now

    async def long_one(k: int) -> None:
        prompt = [rng.randrange(1, vocab) for _ in range(args.long_tokens)]
        start = time.monotonic()
        first = None
        async for _ in router.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                       f"l{k}", policy=RequestPolicy(cache_salt="docs")):
            first = first or time.monotonic() - start
        ttft.append(first)
        if getattr(router, "phases", None) is not None:
            phases.append(dict(router.phases.pop(f"l{k}", {}), ttft=first))

    async def bursts() -> None:
        k = 0
        await asyncio.sleep(args.every / 2)
        tasks = []
        while time.monotonic() < stop - args.every / 2:
            tasks += [asyncio.create_task(long_one(k + j)) for j in range(args.burst)]
            k += args.burst
            await asyncio.sleep(args.every)
        await asyncio.gather(*tasks)

    if isinstance(router, DisaggregatedEngines):
        router.phases = {}
    await asyncio.gather(bursts(), *(stream_loop(i) for i in range(args.streams)))
    breakdown = _breakdown(phases) if phases else {}
    return {**breakdown, "itl_p50_ms": 1e3 * _pct(itl, 0.5), "itl_p99_ms": 1e3 * _pct(itl, 0.99),
            "itl_p999_ms": 1e3 * _pct(itl, 0.999), "itl_max_ms": 1e3 * max(itl, default=float("nan")),
            "ttft_p50_ms": 1e3 * _pct(ttft, 0.5), "ttft_p99_ms": 1e3 * _pct(ttft, 0.99), "long_prompts": len(ttft)}


def _breakdown(phases: list[dict]) -> dict:
    """Medians (ms) of each phase of the long prompts' TTFT in a 1P+1D run (see the module docstring)."""
    remote = [p for p in phases if "prefilled" in p and "first" in p]
    local = [p for p in phases if "local" in p]
    med = lambda xs: round(1e3 * statistics.median(xs), 1) if xs else float("nan")  # noqa: E731
    return {"remote_prompts": len(remote), "local_prompts": len(local),
            "ttft_remote_p50_ms": med([p["ttft"] for p in remote]),
            "ttft_local_p50_ms": med([p["ttft"] for p in local]),
            "phase_wanted_ms": med([p["wanted"] - p["start"] for p in remote]),
            "phase_prefill_queue_ms": med([p.get("prefill_queue_s", 0.0) for p in remote]),
            "phase_prefill_compute_ms": med([p["prefilled"] - p["wanted"] - p.get("prefill_queue_s", 0.0)
                                             for p in remote]),
            "phase_transfer_to_first_ms": med([p["first"] - p["prefilled"] for p in remote])}


async def _kill_and_restart(prefill: AsyncEngine, after_s: float) -> None:
    """SIGKILL the prefill engine after ``after_s`` and start it again once its death is noticed."""
    await asyncio.sleep(after_s)
    os.kill(prefill.pid, signal.SIGKILL)
    while not prefill.dead:
        await asyncio.sleep(0.01)
    await prefill.restart()


async def main(args) -> None:
    model = tempfile.mkdtemp(prefix="moegate-disagg-")
    write_demo_model(model, seed=0)
    base = dict(model=model, dtype="float32", device="cpu", cpu_threads=1, num_kv_blocks=args.kv_blocks,
                max_num_seqs=64, max_num_batched_tokens=args.max_batched_tokens)
    vocab = 200  # token ids from the demo vocabulary's first ids: any id is a valid prompt token
    results = {}
    layouts = (["aggregated x2", "1P + 1D, rule off", "1 prefill + 1 decode"]
               + (["1P + 1D, prefill killed"] if args.fault else []))
    for name in layouts:
        queue_limit = 0 if "rule off" in name else args.prefill_queue_tokens
        if name.startswith("aggregated"):
            engines = [AsyncEngine(EngineConfig(**base)) for _ in range(2)]
            router = ReplicaRouter(engines, ["0", "1"], RouterConfig())
        else:
            prefill = dict(base, max_num_batched_tokens=args.prefill_batched_tokens or args.max_batched_tokens)
            engines = [AsyncEngine(EngineConfig(**prefill, role="prefill")),
                       AsyncEngine(EngineConfig(**base, role="decode", prefill_queue_tokens=queue_limit,
                                                decode_prefill_chunk_tokens=args.decode_prefill_chunk_tokens))]
            router = DisaggregatedEngines(engines[:1], engines[1:])
        await router.start()
        # Killed 0.3 s into the burst nearest halfway, while it computes those long prompts.
        kill_at = args.every / 2 + args.every * int(args.seconds / 2 / args.every) + 0.3
        fault = asyncio.create_task(_kill_and_restart(engines[0], kill_at)) if "killed" in name else None
        try:
            results[name] = await _run(router, args, vocab, seed=1)
            if fault is not None:
                await fault
            await asyncio.sleep(1.5)
            results[name]["leaked_blocks"] = sum(e.stats.kv_blocks_used for e in engines)
            if not name.startswith("aggregated"):
                results[name]["router_fallbacks"] = router.fallbacks
                results[name]["local_prefills"] = router.local_prefills
                d = engines[1].stats
                results[name].update(transfers=d.kv_transfers, fallbacks=d.kv_transfer_fallbacks,
                                     transfer_mb=round(d.kv_transfer_bytes / 2**20, 1),
                                     transfer_ms_mean=round(1e3 * d.kv_transfer_seconds / max(d.kv_transfers, 1), 1))
        finally:
            await router.shutdown()
    if args.fault:
        f = results["1P + 1D, prefill killed"]
        print(f"prefill killed halfway: {f['long_prompts']} long prompts served, ITL p99 {f['itl_p99_ms']:.1f} ms, "
              f"TTFT p50 {f['ttft_p50_ms']:.1f} ms, decode-side fallbacks {f['fallbacks']} (router saw "
              f"{f['router_fallbacks']}), leaked blocks {f['leaked_blocks']}")
    if args.json:
        print(json.dumps(results))
        return
    agg, dis, off = results["aggregated x2"], results["1 prefill + 1 decode"], results["1P + 1D, rule off"]
    print(f"{'':28}{'aggregated x2':>16}{'1P+1D rule off':>16}{'ratio':>8}{'1P + 1D':>16}{'ratio':>8}")
    for key in ("itl_p50_ms", "itl_p99_ms", "itl_p999_ms", "itl_max_ms", "ttft_p50_ms", "ttft_p99_ms"):
        print(f"{key:28}{agg[key]:16.1f}{off[key]:16.1f}{off[key] / agg[key]:8.2f}{dis[key]:16.1f}"
              f"{dis[key] / agg[key]:8.2f}")
    for key in ("remote_prompts", "local_prompts", "ttft_remote_p50_ms", "ttft_local_p50_ms", "phase_wanted_ms",
                "phase_prefill_queue_ms", "phase_prefill_compute_ms", "phase_transfer_to_first_ms"):
        print(f"{key:28}{'':16}{off.get(key, float('nan')):16}{'':8}{dis.get(key, float('nan')):16}")
    print(f"long prompts served: {agg['long_prompts']} / {dis['long_prompts']}; leaked blocks: "
          f"{agg['leaked_blocks']} / {dis['leaked_blocks']}; 1P+1D transfers {dis['transfers']}, fallbacks "
          f"{dis['fallbacks']}, {dis['transfer_mb']} MB, {dis['transfer_ms_mean']} ms mean")
    for name, res in (("rule off", off), ("1P + 1D", dis)):
        print(f"goals, {name}: ITL p99 >= 2x better: {agg['itl_p99_ms'] / res['itl_p99_ms']:.2f}x; "
              f"TTFT p50 <= 1.3x aggregated: {res['ttft_p50_ms'] / agg['ttft_p50_ms']:.2f}x")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--long-tokens", type=int, default=1024)
    p.add_argument("--burst", type=int, default=2)
    p.add_argument("--every", type=float, default=3.0)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--kv-blocks", type=int, default=2048)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--prefill-batched-tokens", type=int, default=0,
                   help="the prefill engines' --max-num-batched-tokens (0: --max-batched-tokens): a prefill engine "
                        "has no streams to keep short steps for")
    p.add_argument("--prefill-queue-tokens", type=int, default=_DEFAULTS["prefill_queue_tokens"],
                   help="the decode engine's prefill_queue_tokens in the 1P+1D run (the other 1P+1D run: 0)")
    p.add_argument("--decode-prefill-chunk-tokens", type=int, default=_DEFAULTS["decode_prefill_chunk_tokens"],
                   help="the decode engine's decode_prefill_chunk_tokens: prompt tokens a step of its own prefills take")
    p.add_argument("--fault", action="store_true", help="add a run whose prefill engine is killed halfway")
    p.add_argument("--json", action="store_true")
    asyncio.run(main(p.parse_args()))
