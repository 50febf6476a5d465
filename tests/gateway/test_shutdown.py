"""Graceful shutdown of a real `moegate serve` process: SIGTERM lets in-flight requests finish up to
the drain timeout, cuts the rest, refuses new connections, and writes every request's usage."""

import asyncio
import random
import signal
import time

import aiohttp

from engine.loading.demo_model import write_demo_model
from tenants.store import TenantStore

from tests.processes import engine_pids, is_running

from .serve_process import free_port, start_server, wait_ready

DRAIN_S = 2.0


async def _stream(http, url: str, key: str, max_tokens: int, first_chunk: asyncio.Event | None = None) -> dict:
    body = {"prompt": "drain me", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    chunks, done = 0, False
    try:
        async with http.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
            assert resp.status == 200, await resp.text()
            async for raw in resp.content:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunks += 1
                    if first_chunk is not None:
                        first_chunk.set()
    except aiohttp.ClientError:
        pass  # the server cut the stream
    return {"chunks": chunks, "done": done, "ended_at": time.monotonic()}


def test_sigterm_drains_in_flight_requests_and_writes_their_usage(tmp_path):
    model = str(tmp_path / "model")
    write_demo_model(model, seed=random.randrange(1000))
    db_url = f"sqlite:///{tmp_path / 'policy.db'}"
    port = free_port()
    # The short stream ends ~0.1 s after SIGTERM: 2 s of drain leave it a wide margin, and bound the test's wait.
    proc, key = start_server(model, db_url, port, "--drain-timeout", str(DRAIN_S), "--data-dir", str(tmp_path / "data"))
    url = f"http://127.0.0.1:{port}"
    output: list[str] = []
    try:
        async def scenario():
            async with aiohttp.ClientSession() as http:
                await wait_ready(url)
                started = asyncio.Event()
                short = asyncio.create_task(_stream(http, url, key, 24, started))
                long = asyncio.create_task(_stream(http, url, key, 4000))  # cannot finish within the drain
                await started.wait()
                t0 = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.5)
                refused = False
                try:
                    async with aiohttp.ClientSession() as fresh, fresh.get(f"{url}/health") as r:
                        refused = r.status == 503  # draining
                except aiohttp.ClientError:
                    refused = True  # no longer accepting connections
                return await short, await long, refused, t0

        short, long, refused, t0 = asyncio.run(scenario())
        proc.wait(timeout=60)
        elapsed = time.monotonic() - t0
        output = proc.stdout.readlines()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, "".join(output[-20:])
    assert short["done"] and short["chunks"] == 24  # finished in full during the drain
    assert not long["done"] and long["chunks"] < 4000  # cut at the drain timeout ...
    # ... not later: aiohttp's own shutdown would let it run for twice the timeout.
    assert DRAIN_S - 0.1 <= long["ended_at"] - t0 < DRAIN_S + 1.5, long["ended_at"] - t0
    assert refused
    assert elapsed < DRAIN_S + 30, elapsed  # the drain timeout bounds the wait (engine shutdown on top)

    async def ledger():
        store = TenantStore.open(db_url)
        try:
            return await store.usage_summary("default", by="tenant")
        finally:
            await store.close()

    rows = asyncio.run(ledger())
    assert sum(r["requests"] for r in rows) == 2  # both requests are in the ledger, the cut one too
    completion = sum(r["completion_tokens"] for r in rows)
    assert 24 < completion < 24 + 4000


def test_sigterm_while_engines_wait_for_their_ranks_stops_the_gateway_at_once(tmp_path):
    """Two replicas (the router cancels each one's start), each split over two ranks, the second to be started by hand on another node (never, here), so
    its engine process waits at the rendezvous for up to 5 minutes. SIGTERM then ends the gateway within
    seconds and takes the waiting engine processes along (before: the gateway waited for them)."""
    replicas = 2
    model = str(tmp_path / "model")
    write_demo_model(model, seed=random.randrange(1000))
    proc, _ = start_server(model, f"sqlite:///{tmp_path / 'policy.db'}", free_port(), "--data-dir", str(tmp_path / "data"),
                           "--data-parallel-size", str(replicas), "--tensor-parallel-size", "2", "--local-ranks", "1",
                           "--distributed-init-method", f"tcp://127.0.0.1:{free_port()}")
    try:
        deadline = time.monotonic() + 60
        while len(engines := engine_pids(proc.pid)) < replicas and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(engines) == replicas, "the engine processes did not start"
        time.sleep(3)  # well into start-up (the demo model builds in about a second)
        assert proc.poll() is None
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        elapsed = time.monotonic() - t0
        deadline = time.monotonic() + 10
        while any(map(is_running, engines)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(is_running, engines)), "an engine process outlived the gateway"
    finally:
        if proc.poll() is None:
            proc.kill()
    assert elapsed < 10, elapsed
    assert proc.returncode == 0
