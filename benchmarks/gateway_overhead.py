"""Gateway overhead: the whole gateway (auth, quota admission, metrics, usage ledger) in front of an
engine that answers at once, against a bare aiohttp handler that returns the same JSON.

    python -m benchmarks.gateway_overhead [--duration 10] [--concurrency 32] [--warmup 1]
        [--unfrozen] [--baseline SOURCE_DIR] [--server-timing]

Runs each server in its own process (one core each side on a 2-core machine: the
client is the other process) and reports:
  * saturation: non-streaming requests/s with ``--concurrency`` requests always in flight;
  * open loop at half the gateway's saturation rate and at 1,000 requests/s: p50/p99
    latency of the gateway and of the bare server at the same rate, and the difference
    (the latency the gateway adds). Latency is measured from each request's scheduled
    send time, so a client that falls behind shows up as latency, not as a lower rate.

Each open-loop run first sends ``--warmup`` seconds of the same traffic on the same
client session, not counted, so connections are open as they are on a server under
steady load. The client is the measuring instrument: its own garbage collector is off
while it measures (its full collections stalled it for 50-100 ms, which read as latency
of whichever server it was measuring). Both servers freeze their startup heap as
``create_app`` does for the gateway. ``--server-timing`` also splits each open-loop
latency into the client's and the server's parts (benchmarks/request_timing.py) and
prints them for all requests and for the slowest 1%. ``other_cpu_pct`` is CPU time used meanwhile by
processes outside the benchmark (the machine is shared), in % of one core.
"""

import argparse
import asyncio
import gc
import itertools
import json
import logging
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import aiohttp

from benchmarks.request_timing import SEQ_HEADER, ClientRecord, breakdown, format_breakdown, now_ns

_SEQ = itertools.count()

BODY = {"model": "instant", "prompt": "Say something short about mixtures of experts.", "max_tokens": 8}


def _install_uvloop() -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass


# -- servers (run in child processes) -------------------------------------------------------------------


def _serve_gateway(port: int, db_url: str, access_log: bool, freeze: bool = True, timing_file: str | None = None) -> None:
    from aiohttp import web

    from benchmarks.instant_engine import InstantEngine
    from gateway.app import create_app
    from gateway.config import GatewayConfig

    from aiohttp.log import access_logger

    if access_log:  # formatted like `moegate serve` does, written nowhere
        logging.basicConfig(level=logging.INFO, stream=open(os.devnull, "w"))
    _install_uvloop()
    app = create_app(GatewayConfig(port=port, database_url=db_url), InstantEngine())
    if not freeze:  # --unfrozen: the gateway without its startup heap freeze, for a side-by-side comparison
        from gateway.heap import freeze_startup_heap

        app.on_startup.remove(freeze_startup_heap)
    if timing_file:
        from benchmarks import request_timing

        request_timing.install(app, timing_file)
    web.run_app(app, host="127.0.0.1", port=port, print=None, handler_cancellation=True,
                access_log=access_logger if access_log else None)


def _serve_bare(port: int, timing_file: str | None = None) -> None:
    from aiohttp import web

    payload = json.dumps({"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "instant",
                          "choices": [{"index": 0, "text": "AAAAAAAA", "logprobs": None, "finish_reason": "length"}],
                          "usage": {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20,
                                    "prompt_tokens_details": {"cached_tokens": 0}}}).encode()

    async def complete(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=payload, content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    from gateway.heap import freeze_startup_heap

    _install_uvloop()
    app = web.Application()
    app.on_startup.append(freeze_startup_heap)  # the reference gets what the gateway gets
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/health", health)
    if timing_file:
        from benchmarks import request_timing

        request_timing.install(app, timing_file)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def _policy(db_url: str) -> str:
    """A fresh SQLite policy database with one tenant (no limits); returns its key."""
    from tenants.migrate import upgrade
    from tenants.store import TenantStore

    upgrade(db_url)

    async def make() -> str:
        store = TenantStore.open(db_url)
        try:
            await store.create_tenant("bench")
            return (await store.create_key("bench"))[1]
        finally:
            await store.close()

    return asyncio.run(make())


# -- client ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _wait_ready(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"server at {url} did not become ready")


async def _one(session: aiohttp.ClientSession, url: str, headers: dict, seq: int | None = None) -> None:
    if seq is not None:
        headers = {**headers, SEQ_HEADER: str(seq)}
    async with session.post(url + "/v1/completions", json=BODY, headers=headers) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")


async def saturation(url: str, headers: dict, concurrency: int, duration_s: float) -> float:
    """Requests/s with ``concurrency`` requests always in flight (after a one-second warm-up)."""
    done = 0
    counting = False
    stop_at = time.monotonic() + 1 + duration_s

    async def worker(session):
        nonlocal done
        while time.monotonic() < stop_at:
            await _one(session, url, headers)
            done += counting

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        tasks = [asyncio.create_task(worker(session)) for _ in range(concurrency)]
        await asyncio.sleep(1)
        counting, start = True, time.monotonic()
        await asyncio.gather(*tasks)
        return done / (time.monotonic() - start)


async def open_loop(url: str, headers: dict, rate: float, duration_s: float, warmup_s: float = 1.0,
                    seed: int = 0, records: list[ClientRecord] | None = None) -> list[float]:
    """Latencies (s) of Poisson arrivals at ``rate``, each measured from its scheduled send time.

    Arrivals in the first ``warmup_s`` seconds are sent but not counted. With ``records``,
    every counted request carries a unique ``x-bench-seq`` and its client-side times are
    appended there (see benchmarks/request_timing.py).
    """
    rng = random.Random(seed)
    latencies: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def timed(at: float, counted: bool) -> None:
            seq = next(_SEQ) if counted and records is not None else None
            started = now_ns()
            await _one(session, url, headers, seq)
            if counted:
                latencies.append(time.perf_counter() - at)
                if seq is not None:
                    records.append(ClientRecord(seq, int(at * 1e9), started, now_ns()))

        tasks, t = [], time.perf_counter() + 0.2
        counted_from = t + warmup_s
        end = counted_from + duration_s
        while t < end:
            delay = t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(timed(t, t >= counted_from)))
            t += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    return latencies


def _measured(coro_fn, *args):
    """Run one measurement with the client's garbage collector off (see the module docstring)."""
    gc.collect()
    gc.disable()
    try:
        return asyncio.run(coro_fn(*args))
    finally:
        gc.enable()


class _OtherCPU:
    """CPU time used by processes other than ``pids`` between ``start`` and ``stop``, in % of one core."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids

    @staticmethod
    def _busy_ticks() -> int:
        # user nice system idle iowait irq softirq steal (guest time is already in user and nice)
        fields = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
        return sum(fields) - fields[3] - fields[4]

    def _ours(self) -> int:
        ticks = 0
        for pid in self.pids:
            try:
                fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
                ticks += int(fields[11]) + int(fields[12])  # utime + stime
            except (OSError, IndexError, ValueError):
                pass
        return ticks

    def start(self) -> None:
        self._t, self._busy, self._mine = time.monotonic(), self._busy_ticks(), self._ours()

    def stop(self) -> float:
        seconds = time.monotonic() - self._t
        other = (self._busy_ticks() - self._busy) - (self._ours() - self._mine)
        return max(0.0, 100.0 * other / os.sysconf("SC_CLK_TCK") / seconds)


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=1000)[int(q * 1000) - 1]


def _start(args: list[str], source: str | None = None) -> subprocess.Popen:
    """A server child; ``source``: run it from that source tree instead (its own code and benchmark)."""
    if source is None:
        return subprocess.Popen([sys.executable, "-m", "benchmarks.gateway_overhead", *args])
    return subprocess.Popen([sys.executable, "-m", "benchmarks.gateway_overhead", *args], cwd=source,
                            env={**os.environ, "PYTHONPATH": source})


def main() -> None:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--duration", type=float, default=10.0, help="seconds per measurement")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of open-loop traffic sent before measuring")
    p.add_argument("--access-log", action="store_true", help="keep aiohttp's access log on in the gateway")
    p.add_argument("--unfrozen", action="store_true",
                   help="also measure the gateway without its startup heap freeze (gateway/heap.py), side by side")
    p.add_argument("--baseline", metavar="SOURCE_DIR",
                   help="also measure the gateway of another source tree (say a git worktree of an older commit), "
                        "side by side; that tree's benchmark serves it")
    p.add_argument("--server-timing", action="store_true",
                   help="split open-loop latencies into client and server parts, for all and the slowest 1%%")
    p.add_argument("--serve", choices=["gateway", "gateway_unfrozen", "bare"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--db", help=argparse.SUPPRESS)
    p.add_argument("--timing-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve in ("gateway", "gateway_unfrozen"):
        return _serve_gateway(args.port, args.db, args.access_log, freeze=args.serve == "gateway",
                              timing_file=args.timing_file)
    if args.serve == "bare":
        return _serve_bare(args.port, args.timing_file)
    if args.server_timing and time.get_clock_info("perf_counter").implementation != "clock_gettime(CLOCK_MONOTONIC)":
        sys.exit("--server-timing needs perf_counter on CLOCK_MONOTONIC (Linux): the client's and the servers' "
                 "times are joined on that clock")
    _install_uvloop()
    gateways = ["gateway"] + (["gateway_unfrozen"] if args.unfrozen else []) + (["baseline"] if args.baseline else [])
    with tempfile.TemporaryDirectory() as tmp:
        db_url = f"sqlite:///{os.path.join(tmp, 'bench.db')}"
        key = _policy(db_url)
        headers = {"Authorization": f"Bearer {key}"}
        procs = {}
        urls = {}
        for name in [*gateways, "bare"]:
            port = _free_port()
            serve = ["--serve", "gateway" if name == "baseline" else name, "--port", str(port)]
            if name != "bare":  # each gateway its own copy of the policy database (same key)
                db = os.path.join(tmp, f"{name}.db")
                shutil.copy(os.path.join(tmp, "bench.db"), db)
                serve += ["--db", f"sqlite:///{db}"] + (["--access-log"] if args.access_log else [])
            if args.server_timing:
                serve += ["--timing-file", os.path.join(tmp, f"{name}.timing.json")]
            procs[name] = _start(serve, os.path.abspath(args.baseline) if name == "baseline" else None)
            urls[name] = f"http://127.0.0.1:{port}"
        results: dict = {}
        client_records: dict[tuple[int, str], list[ClientRecord]] = {}
        try:
            for url in urls.values():
                asyncio.run(_wait_ready(url))
            other = _OtherCPU([os.getpid(), *(proc.pid for proc in procs.values())])
            for name, url in urls.items():
                other.start()
                results[f"{name}_saturation_rps"] = _measured(saturation, url, headers, args.concurrency, args.duration)
                results[f"{name}_saturation_other_cpu_pct"] = other.stop()
                print(f"{name:16s} saturation: {results[f'{name}_saturation_rps']:8.0f} req/s "
                      f"(other processes: {results[f'{name}_saturation_other_cpu_pct']:.0f}% CPU)", flush=True)
            half = results["gateway_saturation_rps"] / 2
            for rate in sorted({round(half), 1000}):
                row = {}
                for name, url in urls.items():
                    other.start()
                    records = client_records.setdefault((rate, name), []) if args.server_timing else None
                    lat = _measured(open_loop, url, headers, rate, args.duration, args.warmup, 0, records)
                    row[name] = {"p50_ms": _pct(lat, 0.5) * 1e3, "p99_ms": _pct(lat, 0.99) * 1e3,
                                 "max_ms": max(lat) * 1e3, "rps": len(lat) / args.duration,
                                 "other_cpu_pct": other.stop()}
                b = row["bare"]
                print(f"open loop {rate:5d} req/s: bare p50 {b['p50_ms']:.2f} ms p99 {b['p99_ms']:.2f} ms "
                      f"(other processes {b['other_cpu_pct']:.0f}% CPU)", flush=True)
                for name in gateways:
                    g = row[name]
                    row[f"{name}_added_p50_ms"] = g["p50_ms"] - b["p50_ms"]
                    row[f"{name}_added_p99_ms"] = g["p99_ms"] - b["p99_ms"]
                    print(f"    {name:16s} p50 {g['p50_ms']:.2f} ms p99 {g['p99_ms']:.2f} ms max {g['max_ms']:.1f} ms | "
                          f"added p50 {row[f'{name}_added_p50_ms']:.2f} ms p99 {row[f'{name}_added_p99_ms']:.2f} ms "
                          f"(other processes {g['other_cpu_pct']:.0f}% CPU)", flush=True)
                results[f"open_loop_{rate}"] = row
        finally:
            for proc in procs.values():
                proc.terminate()
                proc.wait(timeout=30)
        if args.server_timing:  # the servers wrote their records when they stopped
            server = {name: json.load(open(os.path.join(tmp, f"{name}.timing.json"))) for name in procs}
            for (rate, name), records in sorted(client_records.items()):
                split = breakdown(records, server[name])
                results[f"open_loop_{rate}"][name]["breakdown"] = split
                print(f"open loop {rate:5d} req/s:\n" + format_breakdown(name, split), flush=True)
        print(json.dumps(results, indent=1))

if __name__ == "__main__":
    main()
