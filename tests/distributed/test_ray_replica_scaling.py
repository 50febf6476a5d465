"""Scaling Ray replicas while serving: `moegate serve --data-parallel-size 1 --max-data-parallel-size 2
--distributed-executor-backend ray` as a real process with a Ray of its own (loopback only), grown 1 -> 2 -> 1
through ``POST /admin/replicas`` while a load of concurrent streamed completions runs.

The new replica (a placement group of its own) must take requests within seconds of the call's return; the
replica removed while it holds streams lets each finish whole; every request of the load gets a 200 with
exactly the single-process engine's greedy text; the removed replica's rank actor process ends while the
remaining replica's lives on, and its placement group is removed: growing to 2 again finds room (on two cores
Ray has two CPUs, one held by replica 0's group, so a group left behind leaves none).

Slow (Ray starts in 15-30 s on two busy cores): marked ``ray``, skipped without Ray installed."""

import asyncio
import random
import re
import signal
import time

import pytest

from tests.distributed.ray_cluster import WAIT_S
from tests.distributed.test_ray_replicas import ENGINE, Answer, _complete, _greedy, _until
from tests.processes import is_running

pytestmark = pytest.mark.ray

TOKEN = "ray-scaling-admin-token-0123456789"
WORKERS = 3  # concurrent streams of the load: enough that a fresh replica is the less loaded one
MAX_TOKENS = 24
JOIN_WITHIN_S = 5.0  # the new replica must hold a request this soon after the grow call returned
PLACED = re.compile(r"rank 0 on node \w+ \(pid (\d+)")  # the gateway's log line of a replica's placement


def _rank_zero_pids(proc) -> list[int]:
    """The rank 0 actor process of each replica placed so far, in the order the gateway placed them."""
    pids: list[int] = []
    for line in list(proc.output_tail):
        for m in PLACED.finditer(line):
            if int(m.group(1)) not in pids:
                pids.append(int(m.group(1)))
    return pids


@pytest.mark.timeout(150)
def test_ray_replicas_grow_and_shrink_under_load_and_the_removed_group_ends(tmp_path, monkeypatch):
    from aiohttp import ClientSession, ClientTimeout

    from engine import LLM
    from engine.loading.demo_model import write_demo_model
    from tests.gateway.serve_process import free_port, start_server, wait_ready

    pytest.importorskip("ray")
    began = time.monotonic()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # the Ray it starts keeps to loopback
    monkeypatch.setenv("MOEGATE_ADMIN_TOKEN", TOKEN)
    seed = random.randrange(2**31)
    demo = str(tmp_path / "demo")
    write_demo_model(demo, seed=seed % 1000)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    flags = [x for k, v in ENGINE.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    proc, key = start_server(demo, f"sqlite:///{tmp_path / 'policy.db'}", port, "--host", "127.0.0.1",
                             "--data-parallel-size", "1", "--max-data-parallel-size", "2",
                             "--distributed-executor-backend", "ray", *flags, "--drain-timeout", "30",
                             "--served-model-name", "demo", "--data-dir", str(tmp_path / "data"))
    answers: list[tuple[list[int], Answer]] = []
    marks: dict[str, float] = {}
    admin = {"Authorization": f"Bearer {TOKEN}"}

    async def scenario():
        await wait_ready(url, WAIT_S + 30)  # Ray's own start, then replica 0's
        marks["ready"] = time.monotonic() - began
        async with ClientSession(timeout=ClientTimeout(total=WAIT_S)) as http:
            async def replicas() -> dict:
                async with http.get(f"{url}/admin/replicas", headers=admin) as r:
                    assert r.status == 200, await r.text()
                    return await r.json()

            async def on_new(field: str, at_least: int = 1):
                new = next((x for x in (await replicas())["replicas"] if x["replica"] == "1"), None)
                return new is not None and new[field] >= at_least

            async def scale(count: int) -> dict:
                async with http.post(f"{url}/admin/replicas", headers=admin, json={"count": count}) as r:
                    assert r.status == 200, await r.text()
                    return await r.json()

            async def load(stop: asyncio.Event, rng: random.Random):
                while not stop.is_set():
                    prompt = [rng.randrange(10, 1000) for _ in range(rng.randint(3, 20))]
                    answers.append((prompt, await _complete(http, url, key, prompt, MAX_TOKENS)))

            listing = await replicas()
            assert (listing["scalable"], listing["max_count"], [x["replica"] for x in listing["replicas"]]) == \
                (True, 2, ["0"]), listing
            assert len(_rank_zero_pids(proc)) == 1, list(proc.output_tail)[-20:]
            stop = asyncio.Event()
            workers = [asyncio.ensure_future(load(stop, random.Random(seed + w))) for w in range(WORKERS)]
            await _until(lambda: asyncio.sleep(0, len(answers) >= WORKERS), WAIT_S, "the load's first requests")

            # 1 -> 2: a second placement group; it takes requests within seconds of the call's return.
            called = time.monotonic()
            grown = await asyncio.wait_for(scale(2), WAIT_S)
            returned = time.monotonic()
            marks["grow call"] = returned - called
            assert grown["added"] == ["1"] and grown["count"] == 2, grown
            await _until(lambda: on_new("routed"), JOIN_WITHIN_S, "a request routed to the new replica", 0.05)
            marks["first request on the new replica"] = time.monotonic() - returned

            async def both_placed():
                found = _rank_zero_pids(proc)
                return found if len(found) == 2 else None

            pids = await _until(both_placed, 5, "the new replica's placement logged")
            assert all(map(is_running, pids)), pids

            # 2 -> 1 while the leaving replica holds a stream: it finishes whole, then the group is removed.
            await _until(lambda: on_new("in_flight"), 10, "a stream in flight on replica 1", 0.02)
            served_before = len(answers)
            called = time.monotonic()
            shrunk = await asyncio.wait_for(scale(1), WAIT_S)
            marks["shrink call"] = time.monotonic() - called
            assert shrunk["removed"] == ["1"] and [x["replica"] for x in shrunk["replicas"]] == ["0"], shrunk
            await _until(lambda: asyncio.sleep(0, len(answers) >= served_before + WORKERS), WAIT_S,
                         "requests after the shrink")
            stop.set()
            await asyncio.wait_for(asyncio.gather(*workers), WAIT_S)
            await _until(lambda: asyncio.sleep(0, not is_running(pids[1])), 10, "the removed replica's actor ended")
            assert is_running(pids[0]), "the remaining replica's actor ended"
            # Its placement group is removed, not just its actors (which end with their handles anyway): its CPU is
            # free for a new replica (Ray here has one CPU per core; on two cores the only room is that group's).
            again = await asyncio.wait_for(scale(2), 20)
            assert again["added"] == ["1"] and again["count"] == 2, again

    try:
        asyncio.run(asyncio.wait_for(scenario(), 100))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT_S) == 0, list(proc.output_tail)[-20:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=WAIT_S)
    marks["served"] = time.monotonic() - began

    # Every request: a 200 with its whole text, exactly the single-process engine's.
    alone = LLM(demo, **{**ENGINE, "cpu_threads": None})
    want = [o.text for o in alone.generate([p for p, _ in answers], _greedy(MAX_TOKENS))]
    alone.engine.close()
    for (_, got), text in zip(answers, want):
        assert (got.status, got.done, got.error, got.tokens) == (200, True, None, MAX_TOKENS), (got, f"seed={seed}")
        assert got.text == text, (got, text, f"seed={seed}")
    print({k: round(v, 2) for k, v in marks.items()}, f"{len(answers)} requests")
