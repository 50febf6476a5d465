"""Two data-parallel replicas under Ray (``--data-parallel-size 2 --distributed-executor-backend ray``) behind one
in-process gateway, on a local Ray cluster of three 1-CPU nodes (loopback only), one tenant's requests over real
HTTP.

Each replica's rank is its own placement group: with one CPU a node, the two land on two nodes, and both serve,
with exactly the single-process engine's greedy text. Then a worker node holding one replica is removed while
both replicas decode: every request is answered (its whole text, or, on the lost replica only, its tokens so far
and the documented ``503`` error event), requests sent once the gateway saw the loss run on the other replica, the
lost replica's group is placed again on the third node and serves again, and the tenant's usage rows (the ledger
in the tenants database) bill exactly the tokens each client received.

The same command line as a real process, with a Ray of its own: it starts, serves, and drains on SIGTERM.

Slow (a Ray cluster starts in 15-30 s on two busy cores): marked ``ray``, skipped without Ray installed
(``pip install -e '.[ray]'``)."""

import asyncio
import json
import random
import sqlite3
import time
from dataclasses import dataclass

import pytest

from tests.distributed.ray_cluster import WAIT_S, cluster  # noqa: F401 (the fixture)

pytestmark = pytest.mark.ray

ENGINE = dict(device="cpu", cpu_threads=1, block_size=16, num_kv_blocks=64, max_num_batched_tokens=64,
              max_num_seqs=8)
SHORT, LONG = 6, 160  # max_tokens of the requests that must finish, and of those running when the node goes
LOST = ("engine_unavailable", "engine_failed")  # the 503 codes of a request cut by its engine's loss (docs)


@dataclass
class Answer:
    status: int
    request_id: str | None  # the completion's id (the usage row's request_id)
    text: str
    tokens: int  # completion tokens the client received
    error: str | None  # the error event's code, if the stream ended with one
    done: bool  # the stream ended with [DONE]


async def _complete(http, url: str, key: str, prompt: list[int], max_tokens: int,
                    first: asyncio.Event | None = None) -> Answer:
    """One streaming greedy completion, read to its end; ``first`` is set at its first token. Tokens are counted
    from the per-token logprobs (a chunk's text may hold several tokens, or none yet)."""
    body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 0}
    async with http.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, json=body) as r:
        if r.status != 200:
            return Answer(r.status, None, "", 0, (await r.json())["error"].get("code"), False)
        answer = Answer(200, None, "", 0, None, False)
        async for line in r.content:
            line = line.strip()
            if line == b"data: [DONE]":
                answer.done = True
            elif line.startswith(b"data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    answer.error = event["error"].get("code")
                    continue
                choice = event["choices"][0]
                answer.request_id = event["id"]
                answer.text += choice["text"]
                answer.tokens += len(choice["logprobs"]["tokens"])
                if first is not None and answer.tokens:
                    first.set()
        return answer


def _greedy(max_tokens: int):
    from engine.core.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


async def _until(check, timeout_s: float, what: str, every_s: float = 0.1):
    """``await check()`` until it returns something true (returned), for at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = await check()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f} s"
        await asyncio.sleep(every_s)


@pytest.mark.timeout(180)
def test_moegate_serve_starts_two_ray_replicas_and_drains_them_on_sigterm(tmp_path, monkeypatch):
    """The command line with a Ray of its own (no cluster named: the gateway starts one on its node, loopback
    only): `moegate serve --data-parallel-size 2 --distributed-executor-backend ray` joins Ray once for both
    replicas (whose starts run at once), places each in a group of its own and serves; SIGTERM while a stream
    runs drains the gateway (the stream ends whole, the exit status is 0, the usage row is written) rather than
    leaving the process to the crash handler Ray's driver installs for SIGTERM. First in the file: it runs before
    the module's cluster starts."""
    import re
    import signal

    from aiohttp import ClientSession

    from engine.loading.demo_model import write_demo_model
    from tests.gateway.serve_process import free_port, start_server, wait_ready

    pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # the Ray it starts keeps to loopback
    demo = str(tmp_path / "demo")
    write_demo_model(demo, seed=random.randrange(1000))
    db = tmp_path / "policy.db"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc, key = start_server(demo, f"sqlite:///{db}", port, "--host", "127.0.0.1", "--data-parallel-size", "2",
                             "--distributed-executor-backend", "ray", "--cpu-threads", "1",
                             "--served-model-name", "demo", "--data-dir", str(tmp_path / "data"))
    try:
        asyncio.run(wait_ready(url, WAIT_S + 30))  # Ray's own start, then the replicas'
        placed = r"rank 0 on node \w+ \(pid (\d+)"  # the gateway's log line of each replica's placement
        ranks = {m.group(1) for line in list(proc.output_tail) for m in re.finditer(placed, line)}
        assert len(ranks) == 2, ("two replicas' rank 0 actors", list(proc.output_tail)[-20:])

        async def scenario() -> Answer:
            async with ClientSession() as http:
                first = asyncio.Event()
                running = asyncio.ensure_future(_complete(http, url, key, [11, 12, 13], 48, first))
                await asyncio.wait_for(first.wait(), WAIT_S)
                proc.send_signal(signal.SIGTERM)
                return await asyncio.wait_for(running, WAIT_S)

        answer = asyncio.run(scenario())
        assert proc.wait(timeout=WAIT_S) == 0, list(proc.output_tail)[-20:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=WAIT_S)
    assert (answer.status, answer.tokens, answer.done, answer.error) == (200, 48, True, None), answer
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT request_id, completion_tokens, http_status FROM usage").fetchall()
    assert rows == [(answer.request_id, 48, 200)], rows


@pytest.mark.timeout(300)
def test_two_ray_replicas_behind_one_gateway_serve_fail_over_and_come_back_on_the_third_node(cluster, tmp_path):
    from aiohttp import ClientSession
    from aiohttp.test_utils import TestServer

    from engine import LLM
    from engine.core.config import EngineConfig
    from engine.loading.demo_model import write_demo_model
    from gateway.app import create_app
    from gateway.cli.engines import build_engines
    from gateway.config import GatewayConfig
    from tenants.migrate import upgrade
    from tests.gateway.tenant_keys import new_tenant_key

    seed = random.randrange(2**31)
    rng = random.Random(seed)
    demo = str(tmp_path / "demo")
    write_demo_model(demo, seed=seed % 1000)

    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(10, 1000) for _ in range(rng.randint(3, 20))] for _ in range(n)]

    first, long, during, again = prompts(4), prompts(6), prompts(3), prompts(4)
    alone = LLM(demo, **{**ENGINE, "cpu_threads": None})  # this process: its thread count left alone
    want_short = [o.text for o in alone.generate(first + during + again, _greedy(SHORT))]
    want_long = [o.text for o in alone.generate(long, _greedy(LONG))]
    alone.engine.close()
    want_first, want_during, want_again = want_short[:4], want_short[4:7], want_short[7:]

    db = tmp_path / "policy.db"
    url_db = f"sqlite:///{db}"
    upgrade(url_db)
    config = EngineConfig(model=demo, **ENGINE, distributed_executor_backend="ray")
    # As `moegate serve --data-parallel-size 2 --distributed-executor-backend ray` builds them.
    engines = build_engines(config, 2, [], b"", "cache-aware", stall_timeout_s=30.0)
    app = create_app(GatewayConfig(served_model_name="demo", database_url=url_db, data_dir=str(tmp_path / "data"),
                                   engine_restart_backoff_s=1.0, engine_restart_backoff_max_s=2.0), engines)
    answers: list[tuple[list[int], Answer]] = []  # every request's prompt and what its client received

    async def scenario():
        key = await new_tenant_key(url_db, "acme")
        async with TestServer(app, host="127.0.0.1") as server, ClientSession() as http:
            url = str(server.make_url("")).rstrip("/")

            async def ask(prompt, max_tokens, first_token=None) -> Answer:
                answer = await _complete(http, url, key, prompt, max_tokens, first_token)
                answers.append((prompt, answer))
                return answer

            async def all_ready():
                async with http.get(f"{url}/health") as r:
                    body = await r.json()
                return r.status == 200 and all(x["status"] == "ready" for x in body["replicas"])

            await _until(all_ready, WAIT_S, "both replicas ready")
            nodes = [r.group.placement[0][0] for r in engines.replicas]
            assert len(set(nodes)) == 2, f"both replicas on one node of 1 CPU: {nodes} (seed={seed})"

            # Both replicas serve the tenant, with the single-process engine's greedy text.
            got = await asyncio.wait_for(asyncio.gather(*(ask(p, SHORT) for p in first)), WAIT_S)
            assert [(a.status, a.done, a.error) for a in got] == [(200, True, None)] * 4, got
            assert [a.text for a in got] == want_first, f"seed={seed}"
            assert min(engines.routed) > 0, f"a replica got no request: {engines.routed}"

            # A worker node holding a replica leaves while both decode (the head stays: it holds Ray's control
            # services).
            firsts = [asyncio.Event() for _ in long]
            running = [asyncio.ensure_future(ask(p, LONG, e)) for p, e in zip(long, firsts)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), WAIT_S)
            in_flight = list(engines.in_flight)
            assert min(in_flight) > 0, f"a replica had nothing running: {in_flight}"
            lost = next(i for i, node in enumerate(nodes) if node != cluster.head_node.node_id)
            victim = next(n for n in cluster.worker_nodes if n.node_id == nodes[lost])
            third = ({cluster.head_node.node_id} | {n.node_id for n in cluster.worker_nodes}) - set(nodes)
            cluster.remove_node(victim, allow_graceful=False)

            async def lost_replica_down():
                async with http.get(f"{url}/health") as r:
                    return (await r.json())["replicas"][lost]["status"] != "ready"

            # Until the gateway sees the loss (the actor may outlive its node's raylet for a moment) a request sent
            # there is in flight on the lost replica like the others; once it is seen, none goes there.
            await _until(lost_replica_down, 15, "the lost replica noticed", every_s=0.02)
            meanwhile = await asyncio.wait_for(asyncio.gather(*(ask(p, SHORT) for p in during)), WAIT_S)
            cut = await asyncio.wait_for(asyncio.gather(*running), WAIT_S)

            # Requests sent once the loss was seen ran on the replica left (or on the lost one placed again).
            assert [(a.status, a.done, a.error) for a in meanwhile] == [(200, True, None)] * 3, meanwhile
            assert [a.text for a in meanwhile] == want_during, f"seed={seed}"
            # Those running: the whole text, or on the lost replica its text so far and the 503 error event.
            failed = [a for a in cut if a.error is not None]
            assert 0 < len(failed) <= in_flight[lost], (in_flight, cut)
            for a, want in zip(cut, want_long):
                assert a.status == 200 and want.startswith(a.text), (a, f"seed={seed}")
                assert (a.error is None and a.done and a.tokens == LONG and a.text == want) or a.error in LOST, a

            # The supervisor places the lost replica's group again: on the third node, the only one with room.
            await _until(all_ready, WAIT_S + 30, "the lost replica back")
            placed = engines.replicas[lost].group.placement[0][0]
            assert {placed} == third, (placed, third, nodes)
            before = list(engines.routed)
            got = await asyncio.wait_for(asyncio.gather(*(ask(p, SHORT) for p in again)), WAIT_S)
            assert [(a.status, a.done, a.error) for a in got] == [(200, True, None)] * 4, got
            assert [a.text for a in got] == want_again, f"seed={seed}"
            assert engines.routed[lost] > before[lost], f"the replaced replica got no request: {engines.routed}"

            # The ledger bills each request exactly what its client received (rows are written in the background).
            async def rows():
                with sqlite3.connect(db) as conn:
                    found = conn.execute("SELECT request_id, prompt_tokens, completion_tokens, http_status "
                                         "FROM usage").fetchall()
                return found if len(found) >= len(answers) else None

            billed = {rid: row for rid, *row in await _until(rows, WAIT_S, "every request's usage row")}
            assert len(billed) == len(answers), (billed, answers)
            for prompt, a in answers:
                assert billed[a.request_id] == [len(prompt), a.tokens, 503 if a.error else 200], (a, billed)

    asyncio.run(scenario())  # the server's exit stops the app, whose cleanup removes both replicas' groups
    assert [r.group for r in engines.replicas] == [None, None]
