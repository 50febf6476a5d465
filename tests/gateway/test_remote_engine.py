"""`moegate engine --listen` on loopback attached to `moegate serve --engine HOST:PORT` beside a local replica.

What the remote replica returns is checked against the offline engine on the same checkpoint (greedy); then
the remote engine is killed (the local replica keeps serving, /health names the remote one down) and started
again on the same port (the gateway reconnects it: /health ready, and it takes requests again); then it is
frozen (SIGSTOP: the connection stays up, nothing answers) and cut off after the stall timeout, and reconnected
once it runs again.
"""

import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import time

import aiohttp
import pytest

from engine import LLM, SamplingParams
from engine.loading.demo_model import write_demo_model
from tests.gateway.serve_process import _drain, free_port, start_server, wait_ready

pytestmark = pytest.mark.timeout(180)

KEY = "test-engine-key-0123456789"


def _start_engine(model: str, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "engine", "--listen", f"127.0.0.1:{port}", "--model", model,
         "--max-num-seqs", "4", "--cpu-threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "MOEGATE_ENGINE_KEY": KEY})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if re.search(r"engine listening on 127\.0\.0\.1:\d+", line):
            _drain(proc)  # its log must not fill the pipe
            return proc
    proc.kill()
    raise AssertionError("moegate engine did not start listening")


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=10)


def _per_replica(text: str, name: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2))
            for m in re.finditer(rf'^{re.escape(name)}{{replica="([^"]+)"}} (\S+)$', text, re.M)}


def test_remote_engine_serves_fails_over_and_reconnects(tmp_path, monkeypatch):
    model = str(tmp_path / "model")
    write_demo_model(model, seed=5)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 1200) for _ in range(40)] for _ in range(2)]
    offline = LLM(model=model, num_kv_blocks=64).generate(
        prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))

    engine_port, port, metrics_port = free_port(), free_port(), free_port()
    remote = f"127.0.0.1:{engine_port}"
    engine = _start_engine(model, engine_port)
    monkeypatch.setenv("MOEGATE_ENGINE_KEY", KEY)  # the gateway's process inherits it
    server, key = start_server(model, f"sqlite:///{tmp_path / 'policy.db'}", port, "--engine", remote,
                               "--cpu-threads", "1", "--metrics-port", str(metrics_port), "--served-model-name", "demo",
                               "--data-dir", str(tmp_path / "data"), "--engine-stall-timeout", "3",
                               # Reconnecting is tried every second or so while the remote engine is down or frozen,
                               # not after 5 s, 10 s, 20 s...: the test waits on each reconnection.
                               "--engine-restart-backoff", "0.5", "--engine-restart-backoff-max", "1")
    url, metrics_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics"

    async def complete(http, prompt) -> tuple[int, str]:
        async with http.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                             json={"model": "demo", "prompt": prompt, "max_tokens": 6, "temperature": 0,
                                   "ignore_eos": True}) as r:
            body = await r.json()
            return r.status, body["choices"][0]["text"] if r.status == 200 else body

    async def health(http) -> dict:
        async with http.get(f"{url}/health") as r:
            return {"status": r.status, **{x["replica"]: x["status"] for x in (await r.json())["replicas"]}}

    async def wait_for(http, want: dict, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            got = await health(http)
            if all(got.get(k) == v for k, v in want.items()):
                return got
            assert time.monotonic() < deadline, got
            await asyncio.sleep(0.2)

    async def scenario():
        nonlocal engine
        await wait_ready(url)
        async with aiohttp.ClientSession() as http:
            assert await health(http) == {"status": 200, "0": "ready", remote: "ready"}
            # Two prefixes nobody holds: one to each replica (the fewest prompt families).
            results = [await complete(http, p) for p in prompts]
            assert results == [(200, o.text) for o in offline]
            async with http.get(metrics_url) as r:
                prefill = _per_replica(await r.text(), "moegate_prefill_tokens_total")
            assert prefill.get("0", 0) >= 40 and prefill.get(remote, 0) >= 40, prefill

            _stop(engine)
            await wait_for(http, {"status": 200, "0": "ready", remote: "down"}, 30)
            assert [await complete(http, p) for p in prompts] == [(200, o.text) for o in offline]  # the local one

            engine = _start_engine(model, engine_port)  # the same address: the supervisor reconnects
            await wait_for(http, {"status": 200, "0": "ready", remote: "ready"}, 60)
            fresh = [rng.randrange(10, 1200) for _ in range(40)]  # a new family: the emptier (reconnected) one
            assert (await complete(http, fresh))[0] == 200
            async with http.get(metrics_url) as r:
                assert _per_replica(await r.text(), "moegate_prefill_tokens_total").get(remote, 0) >= 40

            # Frozen (alive, silent): the request routed to it is moved after the stall timeout.
            engine.send_signal(signal.SIGSTOP)
            t0 = time.monotonic()
            assert (await complete(http, fresh))[0] == 200
            assert time.monotonic() - t0 >= 3
            await wait_for(http, {"status": 200, "0": "ready", remote: "down"}, 5)
            engine.send_signal(signal.SIGCONT)  # reconnecting resumes once it answers again
            await wait_for(http, {"status": 200, "0": "ready", remote: "ready"}, 90)

    try:
        asyncio.run(scenario())
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        _stop(engine)
