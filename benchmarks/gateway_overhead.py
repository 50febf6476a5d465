"""Gateway overhead: the whole gateway (auth, quota admission, metrics, usage ledger) in front of an
engine that answers at once, against a bare aiohttp handler that returns the same JSON.

    python -m benchmarks.gateway_overhead [--duration 5] [--concurrency 32]

Runs each server in its own process (one core each side on a 2-core machine: the
client is the other process) and reports:
  * saturation: non-streaming requests/s with ``--concurrency`` requests always in flight;
  * open loop at half the gateway's saturation rate and at 1,000 requests/s: p50/p99
    latency of the gateway and of the bare server at the same rate, and the difference
    (the latency the gateway adds). Latency is measured from each request's scheduled
    send time, so a client that falls behind shows up as latency, not as a lower rate.
"""

import argparse
import asyncio
import json
import logging
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import aiohttp

BODY = {"model": "instant", "prompt": "Say something short about mixtures of experts.", "max_tokens": 8}


def _install_uvloop() -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass


# -- servers (run in child processes) -------------------------------------------------------------------


def _serve_gateway(port: int, db_url: str, access_log: bool) -> None:
    from aiohttp import web

    from benchmarks.instant_engine import InstantEngine
    from gateway.app import create_app
    from gateway.config import GatewayConfig

    from aiohttp.log import access_logger

    if access_log:  # formatted like `moegate serve` does, written nowhere
        logging.basicConfig(level=logging.INFO, stream=open(os.devnull, "w"))
    _install_uvloop()
    import gc
    if os.environ.get("BENCH_GC_OFF"):
        gc.disable()
    ttl = float(os.environ.get("BENCH_TTL", "5"))
    app = create_app(GatewayConfig(port=port, database_url=db_url, auth_cache_ttl_s=ttl, policy_cache_ttl_s=ttl),
                     InstantEngine())
    web.run_app(app, host="127.0.0.1", port=port, print=None, handler_cancellation=True,
                access_log=access_logger if access_log else None)


def _serve_bare(port: int) -> None:
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

    _install_uvloop()
    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/health", health)
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


async def _one(session: aiohttp.ClientSession, url: str, headers: dict) -> None:
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


async def open_loop(url: str, headers: dict, rate: float, duration_s: float, seed: int = 0) -> list[float]:
    """Latencies (s) of Poisson arrivals at ``rate``, each measured from its scheduled send time."""
    rng = random.Random(seed)
    latencies: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def timed(at: float) -> None:
            await _one(session, url, headers)
            latencies.append(time.perf_counter() - at)

        tasks, t = [], time.perf_counter() + 0.2
        end = t + duration_s
        while t < end:
            delay = t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(timed(t)))
            t += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    return latencies


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=1000)[int(q * 1000) - 1]


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "benchmarks.gateway_overhead", *args])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--access-log", action="store_true", help="keep aiohttp's access log on in the gateway")
    p.add_argument("--serve", choices=["gateway", "bare"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--db", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve == "gateway":
        return _serve_gateway(args.port, args.db, args.access_log)
    if args.serve == "bare":
        return _serve_bare(args.port)
    _install_uvloop()
    with tempfile.TemporaryDirectory() as tmp:
        db_url = f"sqlite:///{os.path.join(tmp, 'bench.db')}"
        key = _policy(db_url)
        headers = {"Authorization": f"Bearer {key}"}
        ports = {"gateway": _free_port(), "bare": _free_port()}
        procs = {"gateway": _start(["--serve", "gateway", "--port", str(ports["gateway"]), "--db", db_url]
                                   + (["--access-log"] if args.access_log else [])),
                 "bare": _start(["--serve", "bare", "--port", str(ports["bare"])])}
        urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        results: dict = {}
        try:
            for url in urls.values():
                asyncio.run(_wait_ready(url))
            for name, url in urls.items():
                results[f"{name}_saturation_rps"] = asyncio.run(saturation(url, headers, args.concurrency, args.duration))
                print(f"{name:8s} saturation: {results[f'{name}_saturation_rps']:8.0f} req/s", flush=True)
            half = results["gateway_saturation_rps"] / 2
            for rate in sorted({round(half), 1000}):
                row = {}
                for name, url in urls.items():
                    lat = asyncio.run(open_loop(url, headers, rate, args.duration))
                    row[name] = (_pct(lat, 0.5) * 1e3, _pct(lat, 0.99) * 1e3, len(lat) / args.duration)
                added = (row["gateway"][0] - row["bare"][0], row["gateway"][1] - row["bare"][1])
                results[f"open_loop_{rate}"] = {**row, "added_p50_ms": added[0], "added_p99_ms": added[1]}
                print(f"open loop {rate:5d} req/s: gateway p50 {row['gateway'][0]:.2f} ms p99 {row['gateway'][1]:.2f} ms | "
                      f"bare p50 {row['bare'][0]:.2f} ms p99 {row['bare'][1]:.2f} ms | "
                      f"added p50 {added[0]:.2f} ms p99 {added[1]:.2f} ms", flush=True)
        finally:
            for proc in procs.values():
                proc.terminate()
                proc.wait(timeout=30)
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
