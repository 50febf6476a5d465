"""Replicas on two "nodes" that divide the experts between them: `moegate serve --enable-expert-parallel --engine
HOST:PORT --engines-share-experts` (its local replica is rank 0) and `moegate engine --listen HOST:PORT --data-parallel-rank 1` (rank 1),
meeting at one --distributed-init-method, all on loopback.

Both replicas answer what the offline engine on the same checkpoint answers (greedy), and each counts tokens
routed to both ranks' experts; the remote engine's server is killed, which fails the group (clients get 503s, or
an answer the still-alive replica managed), and once it is started again on the same port the gateway restarts
both replicas, which meet again and answer the same.
"""

import asyncio
import random
import re
import time

import aiohttp
import pytest

from engine import LLM, SamplingParams
from engine.loading.demo_model import write_demo_model
from tests.gateway.serve_process import free_port, start_server, stop_server, wait_ready
from tests.gateway.test_remote_engine import KEY, complete_greedy, per_replica, start_engine, stop_engine

pytestmark = pytest.mark.timeout(240)


def test_replicas_on_two_nodes_share_their_experts_and_restart_together(tmp_path, monkeypatch):
    model = str(tmp_path / "model")
    write_demo_model(model, seed=7)
    rng = random.Random()
    prompts = [[rng.randrange(10, 1200) for _ in range(rng.randrange(8, 40))] for _ in range(6)]
    offline = [o.text for o in LLM(model=model, num_kv_blocks=64).generate(
        prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))]

    engine_port, port, metrics_port, meet_port = free_port(), free_port(), free_port(), free_port()
    remote, meet = f"127.0.0.1:{engine_port}", f"tcp://127.0.0.1:{meet_port}"
    group = ("--enable-expert-parallel", "--distributed-init-method", meet, "--distributed-timeout", "5",
             "--kv-cache-memory-gb", "0.05")
    engine_flags = (*group, "--data-parallel-size", "2", "--data-parallel-rank", "1")
    engine = start_engine(model, engine_port, *engine_flags)
    monkeypatch.setenv("MOEGATE_ENGINE_KEY", KEY)  # the gateway's process inherits it
    server, key = start_server(model, f"sqlite:///{tmp_path / 'policy.db'}", port, "--engine", remote, *group,
                               "--engines-share-experts",
                               "--cpu-threads", "1", "--metrics-port", str(metrics_port), "--served-model-name", "demo",
                               "--data-dir", str(tmp_path / "data"), "--engine-stall-timeout", "20",
                               "--engine-restart-backoff", "0.5", "--engine-restart-backoff-max", "1")
    url, metrics_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics"

    async def complete(http, prompt) -> tuple[int, str | dict]:
        return await complete_greedy(http, url, key, prompt)

    async def health(http) -> dict:
        async with http.get(f"{url}/health") as r:
            return {x["replica"]: x["status"] for x in (await r.json())["replicas"]}

    async def wait_for(http, want: dict, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while (got := await health(http)) != want:
            assert time.monotonic() < deadline, got
            await asyncio.sleep(0.2)

    async def both_answer(http) -> None:
        results = await asyncio.gather(*(complete(http, p) for p in prompts))
        assert list(results) == [(200, text) for text in offline]
        async with http.get(metrics_url) as r:
            text = await r.text()
        prefill = per_replica(text, "moegate_prefill_tokens_total")
        assert prefill.get("0", 0) > 0 and prefill.get(remote, 0) > 0, prefill  # both replicas served
        ranks = {(m.group(1), m.group(2)) for m in re.finditer(
            r'^moegate_expert_rank_tokens_total{rank="(\d+)",replica="([^"]+)"} [1-9]', text, re.M)}
        assert {("0", "0"), ("1", "0"), ("0", remote), ("1", remote)} <= ranks, ranks

    async def scenario():
        nonlocal engine
        await wait_ready(url)
        async with aiohttp.ClientSession() as http:
            await wait_for(http, {"0": "ready", remote: "ready"}, 60)
            await both_answer(http)

            stop_engine(engine)  # rank 1's whole server: the local replica fails at its next collective
            statuses = [s for s, _ in await asyncio.gather(*(complete(http, p) for p in prompts))]
            assert set(statuses) <= {200, 503}, statuses
            await wait_for(http, {"0": "down", remote: "down"}, 30)

            engine = start_engine(model, engine_port, *engine_flags)  # same port: both restart and meet again
            await wait_for(http, {"0": "ready", remote: "ready"}, 90)
            await both_answer(http)

    try:
        asyncio.run(scenario())
    finally:
        stop_server(server)
        stop_engine(engine)


# (the remote engine's flags, the gateway's, what the gateway's one-line error must say), end to end; the other
# misplacements are checked without processes below. Before engines said where they belong as the gateway
# connects, the first waited at the rendezvous for five minutes, and in the second the reachable engine was
# attached and built, then waited at its rendezvous until its server's wind-down.
MISPLACED = {
    "two replicas claiming rank 0": (("--data-parallel-size", "2", "--data-parallel-rank", "0", "--meet"),
                                     ("--engines-share-experts",), "--data-parallel-size 2 --data-parallel-rank 1"),
    "another replica unreachable": (("--data-parallel-size", "3", "--data-parallel-rank", "1", "--meet"),
                                    ("--engines-share-experts", "--unreachable-engine"), "cannot reach the engine at"),
}


@pytest.mark.parametrize("place, hello, says", [
    ((1, 2), (0, 1, None), "was started as an independent engine, but this gateway needs it as data-parallel rank 1 "
                           "of 2 of its expert group: start it with --enable-expert-parallel --data-parallel-size 2 "
                           "--data-parallel-rank 1 --distributed-init-method tcp://10.0.0.1:29500"),
    (None, (1, 2, "tcp://10.0.0.1:29500"), "attaches it as an independent replica"),
    ((1, 3), (2, 3, "tcp://10.0.0.1:29500"), "is data-parallel rank 2 of 3, but this gateway needs it as "
                                             "data-parallel rank 1 of 3"),
    ((1, 2), (1, 2, "tcp://10.0.0.1:29501"), "meets its expert group at tcp://10.0.0.1:29501, but this gateway's group "
                                             "meets at tcp://10.0.0.1:29500"),
])
def test_the_gateway_names_the_flags_of_the_place_it_needs(place, hello, says):
    from engine.core.config import EngineConfig
    from engine.serving.async_engine import EngineError
    from engine.serving.protocol import PROTOCOL_VERSION, Hello
    from engine.serving.remote_engine import RemoteEngine

    config = EngineConfig(model="m", enable_expert_parallel=True, distributed_init_method="tcp://10.0.0.1:29500")
    engine = RemoteEngine(config, ("10.0.0.2", 7000), KEY.encode(), group_place=place)
    with pytest.raises(EngineError, match=re.escape(says)):
        engine._check_place(Hello(PROTOCOL_VERSION, *hello))
    right = Hello(PROTOCOL_VERSION, *(place or (0, 1)), "tcp://nodeA:29500" if place else None)  # host spelled apart
    engine._check_place(right)  # no error


@pytest.mark.parametrize("case", list(MISPLACED))
def test_an_engine_outside_its_place_is_refused_at_once(tmp_path, case):
    """The gateway stops at once with one line saying how to start that engine; the engine server started no
    engine for it (it said where it belongs before building anything) and is still there for the next one."""
    import os
    import subprocess
    import sys

    from tests.processes import engine_pids

    engine_flags, gateway_flags, says = MISPLACED[case]
    model = str(tmp_path / "model")
    write_demo_model(model, seed=1)
    engine_port, meet_port = free_port(), free_port()
    meet = ("--distributed-init-method", f"tcp://127.0.0.1:{meet_port}")
    place = {"--meet": meet, "--meet-elsewhere": ("--distributed-init-method", f"tcp://127.0.0.1:{free_port()}")}
    engine_flags = [f for flag in engine_flags for f in place.get(flag, (flag,))]
    gateway_flags = [f for flag in gateway_flags
                     for f in {"--unreachable-engine": ("--engine", f"127.0.0.1:{free_port()}")}.get(flag, (flag,))]
    if "--data-parallel-size" in engine_flags:
        engine_flags.append("--enable-expert-parallel")
    engine = start_engine(model, engine_port, "--kv-cache-memory-gb", "0.05", *engine_flags)
    try:
        begin = time.monotonic()
        run = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "serve", "--model", model, "--port", str(free_port()),
             "--database-url", f"sqlite:///{tmp_path / 'policy.db'}", "--metrics-port", "-1", "--cpu-threads", "1",
             "--kv-cache-memory-gb", "0.05", "--enable-expert-parallel", "--engine", f"127.0.0.1:{engine_port}",
             "--distributed-timeout", "300",  # waiting for the group instead would take minutes, not seconds
             *gateway_flags, *meet],
            capture_output=True, text=True, timeout=120, env={**os.environ, "MOEGATE_ENGINE_KEY": KEY})
        elapsed = time.monotonic() - begin
        assert engine.poll() is None and engine_pids(engine.pid) == []
    finally:
        stop_engine(engine)
    last = run.stderr.strip().splitlines()[-1] if run.stderr.strip() else ""
    assert run.returncode != 0 and last.startswith("moegate serve: error:") and says in last, run.stderr[-2000:]
    assert elapsed < 90, elapsed  # process starts included: tens of seconds on a loaded 2-core machine
