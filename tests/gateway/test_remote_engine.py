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
from tests.gateway.serve_process import _drain, free_port, start_server, stop_server, wait_ready
from tests.processes import engine_pids, is_running, rank_pids

pytestmark = pytest.mark.timeout(180)

KEY = "test-engine-key-0123456789"


def start_engine(model: str, port: int, *flags: str) -> subprocess.Popen:
    """``moegate engine --listen 127.0.0.1:port`` with ``flags``, once it listens (its log drained)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "engine", "--listen", f"127.0.0.1:{port}", "--model", model,
         "--max-num-seqs", "4", "--cpu-threads", "1", *flags],
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


def stop_engine(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=10)


async def complete_greedy(http, url: str, key: str, prompt) -> tuple[int, str | dict]:
    """(status, text or error body) of a greedy 6-token completion from the "demo" model at ``url``."""
    async with http.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                         json={"model": "demo", "prompt": prompt, "max_tokens": 6, "temperature": 0,
                               "ignore_eos": True}) as r:
        body = await r.json()
        return r.status, body["choices"][0]["text"] if r.status == 200 else body


def per_replica(text: str, name: str) -> dict[str, float]:
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
    engine = start_engine(model, engine_port)
    monkeypatch.setenv("MOEGATE_ENGINE_KEY", KEY)  # the gateway's process inherits it
    server, key = start_server(model, f"sqlite:///{tmp_path / 'policy.db'}", port, "--engine", remote,
                               "--cpu-threads", "1", "--metrics-port", str(metrics_port), "--served-model-name", "demo",
                               "--data-dir", str(tmp_path / "data"), "--engine-stall-timeout", "3",
                               # Reconnecting is tried every second or so while the remote engine is down or frozen,
                               # not after 5 s, 10 s, 20 s...: the test waits on each reconnection.
                               "--engine-restart-backoff", "0.5", "--engine-restart-backoff-max", "1")
    url, metrics_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics"

    async def complete(http, prompt) -> tuple[int, str | dict]:
        return await complete_greedy(http, url, key, prompt)

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
                prefill = per_replica(await r.text(), "moegate_prefill_tokens_total")
            assert prefill.get("0", 0) >= 40 and prefill.get(remote, 0) >= 40, prefill

            stop_engine(engine)
            await wait_for(http, {"status": 200, "0": "ready", remote: "down"}, 30)
            assert [await complete(http, p) for p in prompts] == [(200, o.text) for o in offline]  # the local one

            engine = start_engine(model, engine_port)  # the same address: the supervisor reconnects
            await wait_for(http, {"status": 200, "0": "ready", remote: "ready"}, 60)
            fresh = [rng.randrange(10, 1200) for _ in range(40)]  # a new family: the emptier (reconnected) one
            assert (await complete(http, fresh))[0] == 200
            async with http.get(metrics_url) as r:
                assert per_replica(await r.text(), "moegate_prefill_tokens_total").get(remote, 0) >= 40

            # Frozen (alive, silent): the request routed to it is moved after the stall timeout. The engine
            # serving this gateway is a process of the server's own.
            (frozen,) = engine_pids(engine.pid)
            os.kill(frozen, signal.SIGSTOP)
            t0 = time.monotonic()
            assert (await complete(http, fresh))[0] == 200
            assert time.monotonic() - t0 >= 3
            await wait_for(http, {"status": 200, "0": "ready", remote: "down"}, 5)
            os.kill(frozen, signal.SIGCONT)  # reconnecting resumes once it answers again
            await wait_for(http, {"status": 200, "0": "ready", remote: "ready"}, 90)

    try:
        asyncio.run(scenario())
    finally:
        stop_server(server)
        stop_engine(engine)


def test_a_remote_engine_split_over_ranks_serves_gateway_after_gateway(tmp_path):
    """Each gateway connection gets a fresh engine process: an engine split over 2 ranks (its own process group
    and follower) serves a second gateway, connecting the moment the first has left, as it served the first;
    the engine process ends once its gateway has gone; and when the server is killed while a gateway is
    connected, its engine process and that engine's follower rank end too."""
    from engine.core.config import EngineConfig
    from engine.serving.remote_engine import RemoteEngine

    model = str(tmp_path / "model")
    write_demo_model(model, seed=3)
    prompt = [random.randrange(10, 1200) for _ in range(12)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = LLM(model=model, num_kv_blocks=16).generate([prompt], params)[0].token_ids
    engine_port = free_port()
    server = start_engine(model, engine_port, "--tensor-parallel-size", "2", "--kv-cache-memory-gb", "0.05")

    def engine_processes() -> list[int]:
        return engine_pids(server.pid)

    async def tokens(engine) -> list[int]:
        await asyncio.wait_for(engine.start(), 90)
        return [t async for out in engine.generate(prompt, params) for t in out.token_ids]

    async def gateways() -> tuple[list[list[int]], list[int]]:
        got = []
        for _ in range(2):  # the second gateway connects as soon as the first has gone: it waits its turn
            engine = RemoteEngine(EngineConfig(model=model), ("127.0.0.1", engine_port), KEY.encode())
            try:
                got.append(await tokens(engine))
            finally:
                await engine.shutdown()
        deadline = time.monotonic() + 30
        while engine_processes():  # the engine process (and its follower) ends with its gateway
            assert time.monotonic() < deadline, "the engine process outlived its gateway"
            await asyncio.sleep(0.1)
        third = RemoteEngine(EngineConfig(model=model), ("127.0.0.1", engine_port), KEY.encode())
        got.append(await tokens(third))
        (engine_process,) = engine_processes()
        ranks = rank_pids(engine_process)
        assert len(ranks) == 1, ranks
        stop_engine(server)  # killed with a gateway connected
        deadline = time.monotonic() + 20
        while (alive := [p for p in (engine_process, *ranks) if is_running(p)]) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        await third.shutdown()
        return got, alive

    try:
        got, alive = asyncio.run(gateways())
    finally:
        stop_engine(server)
    assert got == [want, want, want]
    assert not alive, f"outlived the server: {alive}"


def test_a_gateway_reconnecting_while_the_last_engine_is_still_ending_is_served_and_a_third_is_told_busy(tmp_path):
    """The engine server says where its engine belongs the moment a gateway connects, so a gateway that
    reconnects while the previous engine takes longer than the connect timeout to end (``LINGER_S``) attaches
    and is served once that engine has ended; a gateway arriving while another is attached is told the engine
    is busy, at once."""
    from engine.core.config import EngineConfig
    from engine.serving.async_engine import EngineError
    from engine.serving.remote_engine import RemoteEngine
    from tests.gateway.failing_step import LINGER_S

    model = str(tmp_path / "model")
    write_demo_model(model, seed=5)
    prompt = [random.randrange(10, 1200) for _ in range(10)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    port = free_port()
    code = ("import sys\n"
            "from engine.core.config import EngineConfig\n"
            "from engine.serving.engine_server import serve_engine\n"
            "from tests.gateway.failing_step import run_then_linger\n"
            f"serve_engine(EngineConfig(model={model!r}, num_kv_blocks=16, cpu_threads=1), ('127.0.0.1', {port}), "
            f"{KEY.encode()!r}, on_listening=lambda a: print('engine listening on 127.0.0.1:%d' % a[1], flush=True), "
            "process_main=run_then_linger)\n")
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, cwd=os.getcwd())
    assert "engine listening" in server.stdout.readline()
    _drain(server)

    def gateway() -> RemoteEngine:
        return RemoteEngine(EngineConfig(model=model), ("127.0.0.1", port), KEY.encode())

    async def scenario():
        first = gateway()
        await asyncio.wait_for(first.start(), 90)
        want = [t async for out in first.generate(prompt, params) for t in out.token_ids]
        busy = gateway()
        with pytest.raises(EngineError, match="serving another gateway"):
            await asyncio.wait_for(busy.start(), 15)
        await first.shutdown()  # its engine now takes LINGER_S to end
        left = time.monotonic()
        second = gateway()
        await asyncio.wait_for(second.start(), 90 + LINGER_S)
        waited = time.monotonic() - left
        got = [t async for out in second.generate(prompt, params) for t in out.token_ids]
        await second.shutdown()
        return want, got, waited

    try:
        want, got, waited = asyncio.run(scenario())
    finally:
        stop_engine(server)
    assert got == want and len(want) == 4
    assert waited >= LINGER_S - 1, waited  # it was served by a fresh engine once the lingering one had ended
