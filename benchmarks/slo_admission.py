"""SLO admission at twice the load a server can take: goodput and the realtime class's attainment with admission
by objective (``slo_action refuse``, which also gives the classes their grace before preempting) and without it
(no objectives in the database: plain priority classes; the load generator judges both arms by the same
objectives), side by side in one run.

    python -m benchmarks.slo_admission [--model DIR] [--device cpu|cuda] [--duration 10] [--rounds 3] [--prompt-len 128]
                                       [--output-len 16] [--realtime-share 0.3] [--load 2.0] [--max-num-seqs 16]
                                       [--max-num-batched-tokens 512] [--json PATH]

``moegate serve`` in a process of its own, on loopback (the demo model unless ``--model``; SQLite in a temporary
directory; prefix caching off, as both arms of a round send the same prompts), the load from this one. First the capacity: a closed loop of ``max_num_seqs`` streams (a full batch, nothing waiting) for
``--capacity-s`` gives the requests per second the server completes, and its time to first token and mean
inter-token latency at that load. The objectives follow from them (unless given): realtime's time to first token
``--rt-ttft-x`` times the closed loop's median, standard's ``--std-ttft-x`` times; both classes' mean inter-token
latency ``--itl-x`` times its median. Then ``--rounds`` rounds, each running both arms (alternating which goes first): an open loop of
Poisson arrivals at ``--load`` times the capacity for ``--duration`` seconds, ``--realtime-share`` of them from a
realtime-class tenant, the rest from a standard-class tenant, the same arrivals for both arms of a round; refused
requests are not retried; each run waits for its last answer before the next starts.

Printed per arm: requests sent, refused (and the slowest refusal's answer time), goodput (requests that met their
class's objectives per second of sending, and their completion tokens per second) and each class's attainment
(met / sent). No asserts: the goal
(goodput at least 1.5x, realtime attainment at least 95% with admission) is read off the numbers.
"""

import argparse
import asyncio
import json
import math
import tempfile
import time
from pathlib import Path

from gateway.config import GatewayConfig
from loadgen.metrics import meets_slo
from loadgen.report import machine_info
from loadgen.runner import run_scenario
from loadgen.scenario import scenario_from_dict
from tenants.migrate import upgrade
from tenants.store import TenantStore
from tests.gateway.serve_process import free_port, start_server, stop_server, wait_ready

CLASSES = {"rt": "realtime", "std": "standard"}
# A key's tenant and class are cached this long by the gateway (GatewayConfig.auth_cache_ttl_s), plus a margin.
CLASS_CACHE_S = GatewayConfig().auth_cache_ttl_s + 1.0


def _start(args, root: Path, url: str):
    """``moegate serve`` in its own process (the load generator must not share the gateway's event loop or its
    core); returns (the process, the API's base URL)."""
    model = args.model
    if model is None:
        from engine.loading.demo_model import write_demo_model

        model = str(root / "demo")
        write_demo_model(model, seed=0)
    port = free_port()
    proc, _ = start_server(model, url, port, "--served-model-name", "bench", "--data-dir", str(root / "data"),
                           "--device", args.device, "--max-num-seqs", str(args.max_num_seqs),
                           "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                           # Both arms of a round send the same prompts: the second would find them cached.
                           "--no-prefix-caching", expect_key=False)
    return proc, f"http://127.0.0.1:{port}"


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


async def _set_objectives(url: str, objectives: dict[str, dict[str, float]], action: str | None) -> None:
    """The classes' objectives with ``action``; None: no objectives at all (plain priority classes)."""
    store = TenantStore.open(url)
    try:
        for cls, bounds in objectives.items():
            if action is None:
                await store.set_class_objectives(cls, ttft_slo_ms=None, itl_slo_ms=None, slo_action="queue")
                continue
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
        {"name": "std", "arrival": "concurrency", "concurrency": args.max_num_seqs}], args.capacity_s))
    o = result.analysis["overall"]
    ok = [r for r in result.records if r.ok]
    itl = sorted(sum(r.itl_s) / len(r.itl_s) for r in ok if r.itl_s)
    return {"requests_per_s": len(ok) / result.duration_s, "ttft_p50_s": o["latency_s"]["ttft"]["p50"],
            "itl_p50_s": itl[len(itl) // 2]}


async def _round(args, base: str, keys: dict, rate: float, objectives: dict, seed: int) -> tuple[list, float]:
    """One open-loop run of ``--duration`` seconds: (its records, its seconds with the drain)."""
    share = args.realtime_share
    scenario = _scenario(args, base, keys, [
        {"name": "rt", "arrival": "poisson", "rate": rate * share},
        {"name": "std", "arrival": "poisson", "rate": rate * (1 - share)}], args.duration, objectives)
    scenario.seed = seed
    result = await run_scenario(scenario)
    return result.records, result.duration_s


def _arm_numbers(args, records: list, run_s: float, objectives: dict, rounds: int | None = None) -> dict:
    sending_s = args.duration * (rounds or args.rounds)
    by_class = {}
    good_total, good_tokens = 0, 0
    for cls in CLASSES.values():
        mine = [r for r in records if r.priority == cls]
        good = [r for r in mine if meets_slo(r, objectives[cls])]
        good_total += len(good)
        good_tokens += sum(r.completion_tokens for r in good)
        refused = [r for r in mine if r.status in (429, 503)]
        ok = [r for r in mine if r.ok]
        by_class[cls] = {"sent": len(mine), "refused": len(refused), "met": len(good),
                         "missed_ttft": sum(1 for r in ok if not meets_slo(r, {"ttft": objectives[cls]["ttft"]})),
                         "missed_itl": sum(1 for r in ok if not meets_slo(r, {"itl": objectives[cls]["itl"]})),
                         "attainment": len(good) / len(mine) if mine else None,
                         "refusal_ms_max": max(((r.end_s - r.sent_s) * 1e3 for r in refused), default=None)}
    return {"sent": len(records), "refused": sum(c["refused"] for c in by_class.values()),
            "goodput_requests_per_s": good_total / sending_s, "goodput_tokens_per_s": good_tokens / sending_s,
            "classes": by_class, "run_s": run_s}


async def bench(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'policy.db'}"
        upgrade(url)
        keys = await _keys(url)
        proc, root_url = _start(args, Path(tmp), url)
        base = root_url + "/v1"
        try:
            await wait_ready(root_url)
            capacity = await _capacity(args, base, keys)
            ttft, itl = capacity["ttft_p50_s"], capacity["itl_p50_s"]
            objectives = {
                "realtime": {"ttft": args.rt_ttft_ms / 1e3 if args.rt_ttft_ms else args.rt_ttft_x * ttft,
                             "itl": args.itl_ms / 1e3 if args.itl_ms else args.itl_x * itl},
                "standard": {"ttft": args.std_ttft_ms / 1e3 if args.std_ttft_ms else args.std_ttft_x * ttft,
                             "itl": args.itl_ms / 1e3 if args.itl_ms else args.itl_x * itl},
            }
            rate = args.load * capacity["requests_per_s"]
            records: dict[str, list] = {"without": [], "with": []}
            run_s = {"without": 0.0, "with": 0.0}
            rounds = []
            # Rounds alternate the arms (and which goes first), the same arrivals for both within a round, so
            # a machine whose speed drifts (shared cores) favours neither.
            for i in range(args.rounds):
                order = [("without", None), ("with", "refuse")]
                for arm, action in (order if i % 2 == 0 else order[::-1]):
                    await _set_objectives(url, objectives, action)
                    await asyncio.sleep(CLASS_CACHE_S)  # the gateway reads the class settings again
                    got, seconds = await _round(args, base, keys, rate, objectives, args.seed + i)
                    records[arm] += got
                    run_s[arm] += seconds
                    one = _arm_numbers(args, got, seconds, objectives, rounds=1)
                    rounds.append({"round": i, "arm": arm, "refused": one["refused"],
                                   "goodput_requests_per_s": one["goodput_requests_per_s"],
                                   "realtime_attainment": one["classes"]["realtime"]["attainment"]})
            arms = {arm: _arm_numbers(args, records[arm], run_s[arm], objectives) for arm in records}
        finally:
            stop_server(proc)
    return {"machine": machine_info(), "date": time.strftime("%Y-%m-%d", time.gmtime()), "args": vars(args),
            "capacity": capacity, "rate_per_s": rate,
            "objectives_ms": {c: {k: round(v * 1e3, 1) for k, v in b.items()} for c, b in objectives.items()},
            "arms": arms, "rounds": rounds}


def _print(out: dict) -> None:
    cap = out["capacity"]
    print(f"capacity: {cap['requests_per_s']:.2f} req/s (closed loop of max_num_seqs; TTFT p50 {cap['ttft_p50_s'] * 1e3:.0f} ms, "
          f"mean ITL p50 {cap['itl_p50_s'] * 1e3:.1f} ms); offered {out['rate_per_s']:.2f} req/s")
    print("objectives (ms): " + "; ".join(f"{c} ttft {b['ttft']:g} itl {b['itl']:g}"
                                          for c, b in out["objectives_ms"].items()))
    rows = [("sent", lambda a: a["sent"]), ("refused", lambda a: a["refused"]),
            ("goodput req/s", lambda a: f"{a['goodput_requests_per_s']:.2f}"),
            ("goodput tok/s", lambda a: f"{a['goodput_tokens_per_s']:.1f}"),
            ("realtime attainment", lambda a: _pct(a["classes"]["realtime"]["attainment"])),
            ("standard attainment", lambda a: _pct(a["classes"]["standard"]["attainment"])),
            ("served, missed ttft", lambda a: sum(c["missed_ttft"] for c in a["classes"].values())),
            ("served, missed itl", lambda a: sum(c["missed_itl"] for c in a["classes"].values())),
            ("slowest refusal ms", lambda a: _ms(a["classes"])),
            ("run s (with drain)", lambda a: f"{a['run_s']:.1f}")]
    print(f"{'':22}{'without':>12}{'with':>12}")
    for name, get in rows:
        print(f"{name:22}{get(out['arms']['without']):>12}{get(out['arms']['with']):>12}")
    for r in out["rounds"]:
        print(f"round {r['round']} {r['arm']:>8}: refused {r['refused']}, goodput {r['goodput_requests_per_s']:.2f} "
              f"req/s, realtime attainment {_pct(r['realtime_attainment'])}")
    without, with_ = out["arms"]["without"]["goodput_requests_per_s"], out["arms"]["with"]["goodput_requests_per_s"]
    print(f"goodput ratio with/without: {with_ / without:.2f}x" if without else "goodput without admission: 0")


def _ms(classes: dict) -> str:
    slowest = [c["refusal_ms_max"] for c in classes.values() if c["refusal_ms_max"] is not None]
    return f"{max(slowest):.1f}" if slowest else "-"


def _pct(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of sending per arm and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each running both arms")
    p.add_argument("--capacity-s", type=float, default=8.0)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--realtime-share", type=float, default=0.3)
    p.add_argument("--load", type=float, default=2.0, help="offered load, times the measured capacity")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--rt-ttft-x", type=float, default=3.0)
    p.add_argument("--std-ttft-x", type=float, default=6.0)
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
