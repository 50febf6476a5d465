"""SLO admission at twice the load a server can take: goodput and the realtime class's attainment with admission
by objective (``slo_action refuse``) and without it (``queue``: the same objectives, judged, not enforced), side by
side in one run.

    python -m benchmarks.slo_admission [--model DIR] [--device cpu|cuda] [--duration 20] [--prompt-len 256]
                                       [--output-len 16] [--realtime-share 0.3] [--load 2.0] [--max-num-seqs 16]
                                       [--max-num-batched-tokens 512] [--json PATH]

One gateway and engine in this process, on loopback (the demo model unless ``--model``; SQLite in a temporary
directory). First the capacity: a closed loop of ``2 * max_num_seqs`` streams for ``--capacity-s`` gives the
requests per second the server completes, and its time to first token and inter-token latency at that load.
The objectives follow from them (unless given): realtime's time to first token ``--rt-ttft-x`` times the
closed loop's median, standard's ``--std-ttft-x`` times; both classes' mean inter-token latency ``--itl-x`` times
its median. Then, for each arm, an open loop of Poisson arrivals at ``--load`` times the capacity for
``--duration`` seconds, ``--realtime-share`` of them from a realtime-class tenant, the rest from a standard-class
tenant, the same arrivals in both arms; refused requests are not retried.

Printed per arm: requests sent, refused, goodput (requests that met their class's objectives per second of
sending, and their completion tokens per second) and each class's attainment (met / sent). No asserts: the goal
(goodput at least 1.5x, realtime attainment at least 95% with admission) is read off the numbers.
"""

import argparse
import asyncio
import json
import math
import tempfile
import time
from pathlib import Path

from aiohttp import web

from engine.core.config import EngineConfig
from engine.serving.async_engine import AsyncEngine
from gateway.app import create_app
from gateway.config import GatewayConfig
from loadgen.metrics import meets_slo
from loadgen.report import machine_info
from loadgen.runner import run_scenario
from loadgen.scenario import scenario_from_dict
from tenants.migrate import upgrade
from tenants.store import TenantStore

CLASSES = {"rt": "realtime", "std": "standard"}


async def _start(args, root: Path) -> tuple[web.AppRunner, str, str]:
    model = args.model
    if model is None:
        from engine.loading.demo_model import write_demo_model

        model = str(root / "demo")
        write_demo_model(model, seed=0)
    url = f"sqlite:///{root / 'policy.db'}"
    upgrade(url)
    engine = AsyncEngine(EngineConfig(model=model, device=args.device, max_num_seqs=args.max_num_seqs,
                                      max_num_batched_tokens=args.max_num_batched_tokens))
    # Class settings are read through the key cache: a short one, so an arm's settings apply a second later.
    app = create_app(GatewayConfig(served_model_name="bench", database_url=url, data_dir=str(root / "data"),
                                   auth_cache_ttl_s=0.5, policy_cache_ttl_s=0.5), engine)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}/v1", url


async def _keys(url: str) -> dict[str, str]:
    store = TenantStore.open(url)
    try:
        keys = {}
        for tenant, cls in CLASSES.items():
            await store.create_tenant(tenant, cls)
            keys[tenant] = (await store.create_key(tenant))[1]
        return keys
    finally:
        await store.close()


async def _set_objectives(url: str, objectives: dict[str, dict[str, float]], action: str) -> None:
    store = TenantStore.open(url)
    try:
        for cls, bounds in objectives.items():
            await store.set_class_objectives(cls, ttft_slo_ms=max(1, round(bounds["ttft"] * 1e3)),
                                             itl_slo_ms=max(1, round(bounds["itl"] * 1e3)), slo_action=action)
    finally:
        await store.close()


def _scenario(args, base: str, keys: dict, tenants: list[dict], duration: float, slo=None):
    return scenario_from_dict({
        "base_url": base, "model": "bench", "duration": duration, "seed": args.seed,
        "slo_by_priority": slo or {},
        "defaults": {"api": "completion", "stream": True, "ignore_eos": True, "max_tokens": args.output_len,
                     "max_retries": 0, "honour_retry_after": False, "timeout_s": 600,
                     "dataset": {"kind": "synthetic", "input_len": f"fixed:{args.prompt_len}",
                                 "output_len": f"fixed:{args.output_len}"}},
        "tenants": [{**t, "api_key": keys[t["name"]], "priority": CLASSES[t["name"]]} for t in tenants],
    })


async def _capacity(args, base: str, keys: dict) -> dict:
    result = await run_scenario(_scenario(args, base, keys, [
        {"name": "std", "arrival": "concurrency", "concurrency": 2 * args.max_num_seqs}], args.capacity_s))
    o = result.analysis["overall"]
    ok = [r for r in result.records if r.ok]
    itl = sorted(sum(r.itl_s) / len(r.itl_s) for r in ok if r.itl_s)
    return {"requests_per_s": len(ok) / result.duration_s, "ttft_p50_s": o["latency_s"]["ttft"]["p50"],
            "itl_p50_s": itl[len(itl) // 2]}


async def _arm(args, base: str, keys: dict, rate: float, objectives: dict) -> dict:
    share = args.realtime_share
    result = await run_scenario(_scenario(args, base, keys, [
        {"name": "rt", "arrival": "poisson", "rate": rate * share},
        {"name": "std", "arrival": "poisson", "rate": rate * (1 - share)}], args.duration, objectives))
    by_class = {}
    good_total, good_tokens = 0, 0
    for cls in CLASSES.values():
        mine = [r for r in result.records if r.priority == cls]
        good = [r for r in mine if meets_slo(r, objectives[cls])]
        good_total += len(good)
        good_tokens += sum(r.completion_tokens for r in good)
        by_class[cls] = {"sent": len(mine), "refused": sum(1 for r in mine if r.status in (429, 503)),
                         "met": len(good), "attainment": len(good) / len(mine) if mine else None}
    return {"sent": len(result.records), "refused": sum(c["refused"] for c in by_class.values()),
            "goodput_requests_per_s": good_total / args.duration, "goodput_tokens_per_s": good_tokens / args.duration,
            "classes": by_class, "run_s": result.duration_s}


async def bench(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        runner, base, url = await _start(args, Path(tmp))
        try:
            keys = await _keys(url)
            capacity = await _capacity(args, base, keys)
            ttft, itl = capacity["ttft_p50_s"], capacity["itl_p50_s"]
            objectives = {
                "realtime": {"ttft": args.rt_ttft_ms / 1e3 if args.rt_ttft_ms else args.rt_ttft_x * ttft,
                             "itl": args.itl_ms / 1e3 if args.itl_ms else args.itl_x * itl},
                "standard": {"ttft": args.std_ttft_ms / 1e3 if args.std_ttft_ms else args.std_ttft_x * ttft,
                             "itl": args.itl_ms / 1e3 if args.itl_ms else args.itl_x * itl},
            }
            rate = args.load * capacity["requests_per_s"]
            arms = {}
            for arm, action in (("without", "queue"), ("with", "refuse")):
                await _set_objectives(url, objectives, action)
                await asyncio.sleep(1.0)  # the key cache's class settings expire (0.5 s)
                arms[arm] = await _arm(args, base, keys, rate, objectives)
        finally:
            await runner.cleanup()
    return {"machine": machine_info(), "date": time.strftime("%Y-%m-%d", time.gmtime()), "args": vars(args),
            "capacity": capacity, "rate_per_s": rate,
            "objectives_ms": {c: {k: round(v * 1e3, 1) for k, v in b.items()} for c, b in objectives.items()},
            "arms": arms}


def _print(out: dict) -> None:
    cap = out["capacity"]
    print(f"capacity: {cap['requests_per_s']:.2f} req/s (closed loop; TTFT p50 {cap['ttft_p50_s'] * 1e3:.0f} ms, "
          f"mean ITL p50 {cap['itl_p50_s'] * 1e3:.1f} ms); offered {out['rate_per_s']:.2f} req/s")
    print("objectives (ms): " + "; ".join(f"{c} ttft {b['ttft']:g} itl {b['itl']:g}"
                                          for c, b in out["objectives_ms"].items()))
    rows = [("sent", lambda a: a["sent"]), ("refused", lambda a: a["refused"]),
            ("goodput req/s", lambda a: f"{a['goodput_requests_per_s']:.2f}"),
            ("goodput tok/s", lambda a: f"{a['goodput_tokens_per_s']:.1f}"),
            ("realtime attainment", lambda a: _pct(a["classes"]["realtime"]["attainment"])),
            ("standard attainment", lambda a: _pct(a["classes"]["standard"]["attainment"])),
            ("run s (with drain)", lambda a: f"{a['run_s']:.1f}")]
    print(f"{'':22}{'without':>12}{'with':>12}")
    for name, get in rows:
        print(f"{name:22}{get(out['arms']['without']):>12}{get(out['arms']['with']):>12}")
    without, with_ = out["arms"]["without"]["goodput_requests_per_s"], out["arms"]["with"]["goodput_requests_per_s"]
    print(f"goodput ratio with/without: {with_ / without:.2f}x" if without else "goodput without admission: 0")


def _pct(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of sending per arm")
    p.add_argument("--capacity-s", type=float, default=8.0)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--realtime-share", type=float, default=0.3)
    p.add_argument("--load", type=float, default=2.0, help="offered load, times the measured capacity")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--rt-ttft-x", type=float, default=2.0)
    p.add_argument("--std-ttft-x", type=float, default=5.0)
    p.add_argument("--itl-x", type=float, default=2.0)
    p.add_argument("--rt-ttft-ms", type=float, default=None)
    p.add_argument("--std-ttft-ms", type=float, default=None)
    p.add_argument("--itl-ms", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the numbers here")
    args = p.parse_args()
    out = asyncio.run(bench(args))
    _print(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
