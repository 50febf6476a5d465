"""Scaling a real `moegate serve` 1 -> 2 -> 1 replicas while a load generator streams requests.

The new replica must take requests within seconds of the call returning (its own `routed` count in
`/admin/replicas` and its decode tokens in `/metrics`); the replica removed while it holds streams must let every
one finish whole (200, the full output, [DONE], no error event), and the usage ledger must count exactly what the
clients received. The admin CLI (`moegate admin replicas set`) drives the growth, the HTTP endpoint the shrink.
"""

import asyncio
import json
import random
import signal
import subprocess
import time

import aiohttp
import pytest

from engine.loading.demo_model import write_demo_model
from gateway.cli import main as moegate
from tests.gateway.serve_process import free_port, start_server, wait_ready

pytestmark = pytest.mark.timeout(150)

TOKEN = "scaling-admin-token-0123456789"
WORKERS = 4  # concurrent streams of the load generator (--max-num-seqs 4 per replica: the load always fits)
MAX_TOKENS = 24
LONG_TOKENS = 250  # the streams a drain too short for cuts
JOIN_WITHIN_S = 5.0  # the new replica must have served a request this soon after the call returned


async def _stream(http, url, key, prompt, max_tokens=None) -> dict:
    """One streamed completion: status, tokens the usage chunk reports, finish reason, error event, [DONE]."""
    got = {"status": None, "completion_tokens": 0, "prompt_tokens": 0, "finish": None, "error": None, "done": False}
    async with http.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                         json={"model": "demo", "prompt": prompt, "max_tokens": max_tokens or MAX_TOKENS, "stream": True,
                               "ignore_eos": True, "stream_options": {"include_usage": True}}) as r:
        got["status"] = r.status
        if r.status != 200:
            return got
        async for line in r.content:
            line = line.strip()
            if line == b"data: [DONE]":
                got["done"] = True
            elif line.startswith(b"data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    got["error"] = event["error"]
                if event.get("usage"):
                    got["completion_tokens"] = event["usage"]["completion_tokens"]
                    got["prompt_tokens"] = event["usage"]["prompt_tokens"]
                for choice in event.get("choices") or ():
                    got["finish"] = choice.get("finish_reason") or got["finish"]
    return got


async def _load(http, url, key, stop: asyncio.Event, results: list, seed: int) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        prompt = [rng.randrange(10, 1200) for _ in range(rng.randrange(8, 40))]
        results.append(await _stream(http, url, key, prompt))


async def _replicas(http, url) -> dict:
    async with http.get(f"{url}/admin/replicas", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def _state(listing: dict, name: str) -> dict | None:
    return next((r for r in listing["replicas"] if r["replica"] == name), None)


async def _decode_tokens(http, metrics_url, replica: str) -> float:
    async with http.get(metrics_url) as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith(f'moegate_decode_tokens_total{{replica="{replica}"}} '):
            return float(line.split()[-1])
    return 0.0


async def _until(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (found := await check()):
        assert time.monotonic() < deadline, f"{what} not within {timeout_s} s"
        await asyncio.sleep(0.05)
    return found


def test_scale_1_2_1_under_load_loses_nothing(tmp_path, monkeypatch, capsys):
    began = time.monotonic()
    monkeypatch.setenv("MOEGATE_ADMIN_TOKEN", TOKEN)
    model, db = str(tmp_path / "model"), f"sqlite:///{tmp_path / 'policy.db'}"
    write_demo_model(model, seed=5)
    port, metrics_port = free_port(), free_port()
    marks_model = time.monotonic()
    proc, key = start_server(model, db, port, "--data-parallel-size", "1", "--max-data-parallel-size", "2",
                             "--max-num-seqs", "4", "--served-model-name", "demo", "--data-dir", str(tmp_path / "data"),
                             "--metrics-port", str(metrics_port), "--drain-timeout", "30")
    url, metrics_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics"
    results: list[dict] = []
    marks = {"start": began, "model": marks_model}

    async def scenario() -> dict:
        await wait_ready(url, timeout_s=90)
        marks["ready"] = time.monotonic()
        stop = asyncio.Event()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            assert [r["replica"] for r in (await _replicas(http, url))["replicas"]] == ["0"]
            load = [asyncio.create_task(_load(http, url, key, stop, results, seed)) for seed in range(WORKERS)]
            await _until(lambda: asyncio.sleep(0, len(results) >= WORKERS), 30, "the load's first requests")

            # 1 -> 2 through the CLI, while the load runs.
            called = time.monotonic()
            rc = await asyncio.to_thread(moegate, ["admin", "replicas", "set", "2", "--url", url, "--json"])
            returned = time.monotonic()
            assert rc == 0, capsys.readouterr().err
            grown = json.loads(capsys.readouterr().out)
            assert grown["added"] == ["1"] and grown["count"] == 2, grown
            await _until(lambda: _routed_on_new(http, url), JOIN_WITHIN_S, "a request routed to the new replica")
            first_request_s = time.monotonic() - returned
            await _until(lambda: _decoded_on_new(http, metrics_url), JOIN_WITHIN_S, "decode tokens on the new replica")
            async with http.get(f"{url}/health") as r:
                assert [x["status"] for x in (await r.json())["replicas"]] == ["ready", "ready"]

            # 2 -> 1 while the replica that leaves holds streams.
            await _until(lambda: _holds_streams(http, url), 10, "streams in flight on replica 1")
            before = len(results)
            async with http.post(f"{url}/admin/replicas", headers={"Authorization": f"Bearer {TOKEN}"},
                                 json={"count": 1}) as r:
                assert r.status == 200, await r.text()
                shrunk = await r.json()
            marks["shrunk"] = time.monotonic()
            assert shrunk["removed"] == ["1"] and [x["replica"] for x in shrunk["replicas"]] == ["0"], shrunk
            await _until(lambda: asyncio.sleep(0, len(results) >= before + 2 * WORKERS), 30, "requests after the shrink")
            stop.set()
            marks["load done"] = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*load), 30)
            async with http.get(f"{url}/health") as r:
                assert r.status == 200 and [x["replica"] for x in (await r.json())["replicas"]] == ["0"]
            assert await _decode_tokens(http, metrics_url, "1") == 0.0  # its series left with it
            async with http.post(f"{url}/admin/replicas", headers={"Authorization": f"Bearer {TOKEN}"},
                                 json={"count": 3}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "count"
            # The ledger counts exactly what the clients received (it is written shortly after each request).
            await _until(lambda: asyncio.to_thread(_ledger_has, len(results)), 15, "the ledger's rows")
            usage = await asyncio.to_thread(_ledger)
            marks["ledger"] = time.monotonic()
            assert sum(row["requests"] for row in usage) == len(results)
            assert sum(row["completion_tokens"] for row in usage) == sum(r["completion_tokens"] for r in results)
            assert sum(row["prompt_tokens"] for row in usage) == sum(r["prompt_tokens"] for r in results)

            # A drain that runs out of time: streams still on the leaving replica end with the engine's error
            # event (not a hang); the rest finish whole.
            await _set(http, 2)
            long = [asyncio.create_task(_stream(http, url, key, [11 + k, 12, 13], LONG_TOKENS)) for k in range(4)]
            await _until(lambda: _holds_streams(http, url, 1), 10, "long streams on replica 1")
            await asyncio.sleep(0.3)  # they have started (produced output): they cannot run elsewhere
            cut_call = await _set(http, 1, drain_timeout_s=0.2)
            marks["cut"] = time.monotonic()
            cut = await asyncio.wait_for(asyncio.gather(*long), 30)
            marks["long done"] = time.monotonic()
        for r in cut:
            assert r["status"] == 200 and (r["error"] is None) == (r["completion_tokens"] == LONG_TOKENS), r
        assert sum(r["error"] is not None and r["error"]["code"] == "engine_unavailable" for r in cut) >= 1, cut
        assert cut_call["seconds"] < 0.2 + 5.0, cut_call
        return {"grow_call_s": round(returned - called, 2), "first_request_after_return_s": round(first_request_s, 2),
                "shrink_call_s": shrunk["seconds"], "cut_call_s": cut_call["seconds"]}

    async def _routed_on_new(http, url):
        new = _state(await _replicas(http, url), "1")
        return new is not None and new["routed"] > 0

    async def _decoded_on_new(http, metrics_url):
        return await _decode_tokens(http, metrics_url, "1") > 0

    async def _holds_streams(http, url, at_least=2):
        new = _state(await _replicas(http, url), "1")
        return new is not None and new["in_flight"] >= at_least

    async def _set(http, count, **extra):
        async with http.post(f"{url}/admin/replicas", headers={"Authorization": f"Bearer {TOKEN}"},
                             json={"count": count, **extra}) as r:
            assert r.status == 200, await r.text()
            return await r.json()

    def _ledger() -> list[dict]:
        capsys.readouterr()
        assert moegate(["admin", "usage", "--by", "tenant", "--json", "--database-url", db]) == 0
        return json.loads(capsys.readouterr().out)

    def _ledger_has(requests: int) -> bool:
        return sum(row["requests"] for row in _ledger()) >= requests

    try:
        timings = asyncio.run(asyncio.wait_for(scenario(), 120))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        marks["stopped"] = time.monotonic()
    with capsys.disabled():  # the numbers docs/scaling.md quotes
        print(f"\nscaling: {timings}, requests: {len(results)}",
              {k: round(v - marks["start"], 1) for k, v in marks.items()})

    lost = [r for r in results if r["status"] != 200 or r["error"] or not r["done"] or r["finish"] != "length"
            or r["completion_tokens"] != MAX_TOKENS]
    assert not lost, lost[:3]
