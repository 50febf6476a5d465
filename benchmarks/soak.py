"""Soak: minutes of mixed multi-tenant load on a real `moegate serve`, watching for leaks.

    python -m benchmarks.soak [--minutes 10] [--sample-s 15] [--model DIR] [--no-abuse]

Starts `moegate serve` (the demo model unless --model, SQLite in a temporary
directory) and, for ``--minutes``, sends from four tenants at once:

* ``steady``: streamed completions with usage, 4 at a time;
* ``cutter``: streams it drops after the first event (client cancels);
* ``limited``: a 60 requests/minute limit it keeps exceeding (429s);
* ``bulk``: one 400-line Batch API job at the start, then another each time one completes;
* abuse (``benchmarks/soak_abuse.py``): ``hoarder``'s streams that are never read, ``schemer``'s flood of new
  and refused JSON schemas; and ``probe``, a realtime-class tenant whose time to first token is measured alone
  for ``--idle-s`` before everything starts (idle) and then under the whole load.

Every ``--sample-s`` it records the gateway's and the engine's RSS and open file
descriptors and the KV blocks in use (from /metrics). At the end it waits for the
engine to go idle, stops the server (the ledger writes what is left), and compares
the usage ledger with what clients received: completion tokens of every finished
stream, one row per dropped stream (499, or 200 if it had been sent whole before
the client left), no row for a 429, one row per batch line.

Prints one table of samples and a JSON verdict: RSS growth from the sample at
minute 2 to the last (goal: within 5%), file descriptors at minute 2 and at the
end (goal: flat), the ledger against the clients (goal: equal), KV blocks at the
end (goal: 0), the probe's TTFT p99 under load against idle (goal: at most 3x).
"""

import argparse
import asyncio
import io
import json
import os
import random
import re
import sqlite3
import subprocess
import sys
import tempfile
import time

import aiohttp

from benchmarks.soak_abuse import AbuseTally, hoarder, percentile, realtime_probe, schemer
from tests.gateway.serve_process import free_port, start_server, wait_ready


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _engine_pid(gateway_pid: int) -> int | None:
    """The engine process: the gateway's child that runs the model (the largest child by RSS)."""
    children = []
    for tid in os.listdir(f"/proc/{gateway_pid}/task"):
        with open(f"/proc/{gateway_pid}/task/{tid}/children") as f:
            children += [int(p) for p in f.read().split()]
    alive = [p for p in children if os.path.exists(f"/proc/{p}")]
    return max(alive, key=_rss_mb) if alive else None


class Tally:
    def __init__(self) -> None:
        self.completion_tokens = 0  # of streams that finished, from their usage chunk
        self.finished = 0
        self.cut = 0
        self.limited = 0
        self.other: dict[int, int] = {}


async def _stream(http, url: str, key: str, tally: Tally, cut: bool) -> None:
    body = {"model": "demo", "prompt": f"story {random.random()}", "max_tokens": random.randint(8, 48),
            "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status == 429:
            tally.limited += 1
            await r.read()
            return
        if r.status != 200:
            tally.other[r.status] = tally.other.get(r.status, 0) + 1
            await r.read()
            return
        if cut:
            await r.content.readline()
            tally.cut += 1
            return  # leaving the block drops the connection mid-stream
        async for line in r.content:
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                if event.get("usage"):
                    tally.completion_tokens += event["usage"]["completion_tokens"]
        tally.finished += 1


async def _tenant_loop(url: str, key: str, tally: Tally, stop: float, parallel: int, cut: bool, pause_s: float) -> None:
    connector = aiohttp.TCPConnector(force_close=cut)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as http:
        async def one_lane():
            while time.monotonic() < stop:
                await _stream(http, url, key, tally, cut)
                await asyncio.sleep(pause_s * random.random())

        await asyncio.gather(*(one_lane() for _ in range(parallel)))


async def _batches(url: str, key: str, stop: float, done: list[int]) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=2)
    while time.monotonic() < stop:
        lines = [{"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "demo", "prompt": f"line {i} {random.random()}", "max_tokens": 8}}
                 for i in range(400)]
        data = ("\n".join(json.dumps(line) for line in lines) + "\n").encode()
        f = await client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        batch = await client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        while batch.status not in ("completed", "failed", "cancelled", "expired") and time.monotonic() < stop + 120:
            await asyncio.sleep(2)
            batch = await client.batches.retrieve(batch.id)
        done.append(batch.request_counts.completed if batch.status == "completed" else -1)


async def _kv_blocks_used(http, metrics_url: str) -> int | None:
    try:
        async with http.get(metrics_url) as r:
            text = await r.text()
    except aiohttp.ClientError:
        return None
    found = re.search(r"^moegate_kv_blocks_used(?:\{[^}]*\})? (\S+)", text, re.M)
    return int(float(found.group(1))) if found else None


async def soak(args) -> dict:
    tmp = tempfile.mkdtemp(prefix="moegate-soak-")
    model = args.model
    if model is None:
        from engine.loading.demo_model import write_demo_model

        model = os.path.join(tmp, "demo")
        write_demo_model(model, seed=0)
    db = os.path.join(tmp, "policy.db")
    port, metrics_port = free_port(), free_port()
    # The KV pool's memory is taken as its blocks are first written: a pool the load fills only after minute 2
    # would read as growth. --kv-cache-memory-gb sizes it (a quarter GB fills within the first minute here).
    proc, default_key = start_server(model, f"sqlite:///{db}", port, "--served-model-name", "demo",
                                     "--data-dir", os.path.join(tmp, "data"), "--metrics-port", str(metrics_port),
                                     "--kv-cache-memory-gb", str(args.kv_cache_memory_gb))
    url, metrics_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics"
    await wait_ready(url)
    env = {**os.environ, "MOEGATE_DATABASE_URL": f"sqlite:///{db}"}
    keys = {}
    for name in ("steady", "cutter", "limited", "bulk", "hoarder", "schemer", "probe"):
        subprocess.run([sys.executable, "-m", "gateway.cli", "admin", "tenant", "create", name,
                        "--class", "realtime" if name == "probe" else "standard"], env=env, check=True,
                       capture_output=True)
        made = subprocess.run([sys.executable, "-m", "gateway.cli", "admin", "key", "create", name, "--json"], env=env,
                              check=True, capture_output=True, text=True)
        keys[name] = json.loads(made.stdout)["key"]
    subprocess.run([sys.executable, "-m", "gateway.cli", "admin", "quota", "set", "limited", "--rpm", "60"], env=env,
                   check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "gateway.cli", "admin", "quota", "set", "schemer", "--rpm", "120"], env=env,
                   check=True, capture_output=True)
    idle, abuse = AbuseTally(), AbuseTally()
    await realtime_probe(url, keys["probe"], idle, time.monotonic() + args.idle_s)  # alone: the idle baseline

    tallies = {name: Tally() for name in ("steady", "cutter", "limited")}
    batches_done: list[int] = []
    start = time.monotonic()
    stop = start + args.minutes * 60
    samples = []

    async def sampler():
        async with aiohttp.ClientSession() as http:
            while True:
                engine = _engine_pid(proc.pid)
                samples.append({"t_s": round(time.monotonic() - start), "gateway_rss_mb": round(_rss_mb(proc.pid), 1),
                                "engine_rss_mb": round(_rss_mb(engine), 1) if engine else None,
                                "gateway_fds": _fds(proc.pid), "engine_fds": _fds(engine) if engine else None,
                                "kv_blocks_used": await _kv_blocks_used(http, metrics_url)})
                print(samples[-1], flush=True)
                if time.monotonic() >= stop:
                    return
                await asyncio.sleep(min(args.sample_s, max(stop - time.monotonic(), 0.0)))

    await asyncio.gather(
        sampler(),
        _tenant_loop(url, keys["steady"], tallies["steady"], stop, 4, cut=False, pause_s=0.2),
        _tenant_loop(url, keys["cutter"], tallies["cutter"], stop, 2, cut=True, pause_s=0.5),
        _tenant_loop(url, keys["limited"], tallies["limited"], stop, 1, cut=False, pause_s=0.2),
        _batches(url, keys["bulk"], stop, batches_done),
        *([hoarder("127.0.0.1", port, keys["hoarder"], abuse, stop), schemer(url, keys["schemer"], abuse, stop)]
          if args.abuse else []),
        realtime_probe(url, keys["probe"], abuse, stop),
    )
    # Quiet: cut streams' aborts and the last batch lines have left the engine.
    async with aiohttp.ClientSession() as http:
        for _ in range(120):
            if await _kv_blocks_used(http, metrics_url) == 0:
                break
            await asyncio.sleep(0.5)
        kv_end = await _kv_blocks_used(http, metrics_url)
    end_sample = {"gateway_rss_mb": round(_rss_mb(proc.pid), 1), "gateway_fds": _fds(proc.pid)}
    proc.terminate()
    proc.wait(timeout=60)

    with sqlite3.connect(db) as conn:
        rows = dict(conn.execute(
            "SELECT t.name || ':' || u.http_status, COUNT(*) FROM usage u JOIN tenants t ON t.id = u.tenant_id "
            "WHERE u.batch = 0 GROUP BY 1").fetchall())
        tokens = dict(conn.execute(
            "SELECT t.name, SUM(u.completion_tokens) FROM usage u JOIN tenants t ON t.id = u.tenant_id "
            "WHERE u.batch = 0 AND u.http_status = 200 GROUP BY 1").fetchall())
        batch_rows = conn.execute("SELECT COUNT(*) FROM usage WHERE batch = 1").fetchone()[0]
    at2 = next((s for s in samples if s["t_s"] >= 120), samples[0])
    last = samples[-1]
    clients = {name: vars(t) for name, t in tallies.items()}
    ledger_ok = (
        rows.get("steady:200", 0) == tallies["steady"].finished
        and tokens.get("steady", 0) == tallies["steady"].completion_tokens
        # one row per dropped stream: 499, or 200 when it had already been sent whole
        and rows.get("cutter:499", 0) + rows.get("cutter:200", 0) == tallies["cutter"].cut
        and rows.get("limited:200", 0) == tallies["limited"].finished
        and tokens.get("limited", 0) == tallies["limited"].completion_tokens
        and not any(k.endswith(":429") for k in rows)
        # every batch ran to completion (the last one is waited for), each line billed once
        and all(n > 0 for n in batches_done) and batch_rows == sum(batches_done)
    )
    verdict = {
        "minutes": args.minutes, "with_abuse": args.abuse,
        "gateway_rss_growth_pct": round(100 * (last["gateway_rss_mb"] / at2["gateway_rss_mb"] - 1), 1),
        "engine_rss_growth_pct": round(100 * (last["engine_rss_mb"] / at2["engine_rss_mb"] - 1), 1)
        if last["engine_rss_mb"] and at2["engine_rss_mb"] else None,
        "gateway_fds_min2_end": [at2["gateway_fds"], last["gateway_fds"]],
        "engine_fds_min2_end": [at2["engine_fds"], last["engine_fds"]],
        "kv_blocks_used_at_end": kv_end,
        "clients": clients,
        "batches_completed_lines": batches_done,
        "ledger_rows": rows, "ledger_completion_tokens": tokens, "ledger_batch_rows": batch_rows,
        "ledger_equals_clients": ledger_ok,
        "abuse": {"unread_streams": abuse.unread_streams, "schema_statuses": abuse.schema_statuses},
        "realtime_ttft_ms": {"idle_p50": percentile(idle.ttft_ms, 0.5), "idle_p99": percentile(idle.ttft_ms, 0.99),
                             "load_p50": percentile(abuse.ttft_ms, 0.5), "load_p99": percentile(abuse.ttft_ms, 0.99),
                             "idle_n": len(idle.ttft_ms), "load_n": len(abuse.ttft_ms)},
        "realtime_ttft_p99_ratio": round(percentile(abuse.ttft_ms, 0.99) / percentile(idle.ttft_ms, 0.99), 2)
        if idle.ttft_ms and abuse.ttft_ms else None,
        "after_idle": end_sample,
    }
    return verdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--sample-s", type=float, default=15.0)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=0.25, help="the server's KV pool (CPU)")
    parser.add_argument("--no-abuse", dest="abuse", action="store_false",
                        help="without the abusive tenants: the realtime probe under the ordinary load alone")
    parser.add_argument("--idle-s", type=float, default=30.0, help="the realtime probe alone first, for its idle TTFT")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(soak(args)), indent=2))


if __name__ == "__main__":
    main()
