"""`moegate serve --data-parallel-size 2`: two real engine replicas behind the router, over real HTTP.

Affinity is read from the engines' own counts (each response's cached prompt tokens); balance, the Batch
API's spread and rejoining from the per-replica /metrics series; failover from what clients receive when a
replica's process is killed. The tests share one server, in file order (the failover test kills a replica last).
"""

import asyncio
import io
import json
import os
import random
import re
import signal
import time

import aiohttp
import openai
import pytest

from engine.loading.demo_model import write_demo_model
from tests.gateway.serve_process import free_port, start_server, wait_ready
from tests.processes import engine_pids

pytestmark = pytest.mark.timeout(180)

SLOTS = 4  # --max-num-seqs of each replica
PREFIX = 160  # tokens: 10 full blocks
STALL_S = 3  # --engine-stall-timeout


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from _serve(tmp_path_factory, with_adapter=False)


@pytest.fixture
def adapter_server(tmp_path_factory):
    """Replicas that serve LoRA (a public adapter registered before the server starts), for the adapter test
    alone: the other tests keep replicas without adapter slot tables."""
    yield from _serve(tmp_path_factory, with_adapter=True)


def _serve(tmp_path_factory, with_adapter: bool):
    root = tmp_path_factory.mktemp("replicas")
    model = str(root / "model")
    write_demo_model(model, seed=3)
    if with_adapter:
        _public_adapter(model, str(root / "adapter"), f"sqlite:///{root / 'policy.db'}")
    port, metrics_port = free_port(), free_port()
    proc, key = start_server(model, f"sqlite:///{root / 'policy.db'}", port, "--data-parallel-size", "2",
                             "--max-num-seqs", str(SLOTS), "--metrics-port", str(metrics_port),
                             "--served-model-name", "demo", "--data-dir", str(root / "data"),
                             "--engine-stall-timeout", str(STALL_S))
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(wait_ready(url, timeout_s=120))
        yield proc, key, url, f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except Exception:
            proc.kill()
            proc.wait(timeout=10)


def _public_adapter(model: str, path: str, db_url: str) -> None:
    """A PEFT LoRA adapter of ``model`` registered as the public ``ad`` before the server starts (its replicas then
    serve LoRA, and the router prefers the replicas holding an adapter: ``test_adapter_requests_stay_together``)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from gateway.cli import main as moegate
    from tenants.migrate import upgrade

    base = AutoModelForCausalLM.from_pretrained(model)
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)).save_pretrained(path)
    upgrade(db_url)
    assert moegate(["admin", "adapter", "add", "ad", "--path", path, "--public", "--database-url", db_url]) == 0


def _prefix(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1200) for _ in range(PREFIX)]


def _per_replica(text: str, name: str) -> dict[str, float]:
    """{replica: value} of one metric family from Prometheus text."""
    out = {}
    for m in re.finditer(rf'^{re.escape(name)}{{replica="(\w+)"}} (\S+)$', text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


async def _metrics(http: aiohttp.ClientSession, metrics_url: str) -> str:
    async with http.get(metrics_url) as r:
        assert r.status == 200
        return await r.text()


async def _complete(http, url, key, prompt, max_tokens=2) -> dict:
    async with http.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                         json={"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def _stream(http, url, key, prompt, max_tokens) -> tuple[int, int, dict | None, bool]:
    """(status, content chunks, error event or None, saw [DONE]) of one streaming completion."""
    async with http.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                         json={"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                               "ignore_eos": True}) as r:
        if r.status != 200:
            return r.status, 0, None, False
        chunks, error, done = 0, None, False
        async for line in r.content:
            line = line.strip()
            if line == b"data: [DONE]":
                done = True
            elif line.startswith(b"data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                else:
                    chunks += 1
        return 200, chunks, error, done


def test_affinity_requests_sharing_a_prefix_land_on_the_replica_that_holds_it(server):
    """Three requests in a row behind each of two prefixes: every one after the first is served from the
    prefix cache (round-robin would send the second to the other replica: no hit), and the two prefixes
    went to different replicas (a prefix nobody holds goes to the emptiest one)."""
    _, key, url, metrics_url = server

    async def scenario():
        async with aiohttp.ClientSession() as http:
            for seed in (1, 2):
                prefix = _prefix(seed)
                cached = []
                for i in range(3):
                    body = await _complete(http, url, key, prefix + [7, 8, 9, 10 + i])
                    cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
                assert cached[0] == 0 and cached[1:] == [PREFIX, PREFIX], cached
            prefill = _per_replica(await _metrics(http, metrics_url), "moegate_prefill_tokens_total")
            assert set(prefill) == {"0", "1"} and all(v >= PREFIX for v in prefill.values()), prefill

    asyncio.run(scenario())


def test_adapter_requests_stay_on_the_replica_holding_their_adapter(adapter_server):
    """One after another, prompts no replica holds: base-model ones alternate (a prefix nobody holds goes to the
    replica with the fewest prompt families), while an adapter's all go to the replica that first got it."""
    _, key, url, metrics_url = adapter_server
    rng = random.Random()

    async def run(model: str) -> dict[str, float]:
        async with aiohttp.ClientSession() as http:
            before = _per_replica(await _metrics(http, metrics_url), "moegate_prefill_tokens_total")
            for _ in range(4):
                prompt = [rng.randrange(10, 1200) for _ in range(40)]  # two full blocks, a new family each time
                async with http.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                     json={"model": model, "prompt": prompt, "max_tokens": 1}) as r:
                    assert r.status == 200, await r.text()
                    assert (await r.json())["model"] == model
            after = _per_replica(await _metrics(http, metrics_url), "moegate_prefill_tokens_total")
            return {k: after[k] - before.get(k, 0) for k in after}

    base = asyncio.run(run("demo"))
    assert all(v > 0 for v in base.values()) and len(base) == 2, base  # spread: the preference below is real
    adapter = asyncio.run(run("ad"))
    assert sorted(adapter.values())[0] == 0 and sum(adapter.values()) >= 4 * 40, adapter


def test_balance_no_replica_idles_while_the_other_has_a_queue(server):
    """16 requests at once behind one prefix that one replica holds, 4 slots each: affinity alone would
    queue 12 there with the other idle; the router fills the other's slots, then joins the shorter queue,
    and moves queued requests to a replica that drains first.
    The engines' own reports, sampled throughout, never show one waiting while the other does nothing."""
    _, key, url, metrics_url = server

    async def scenario():
        async with aiohttp.ClientSession() as http:
            prefix = _prefix(1)  # held by one replica since the affinity test (or its first request here)
            await _complete(http, url, key, prefix + [5])
            before = _per_replica(await _metrics(http, metrics_url), "moegate_decode_tokens_total")
            burst = asyncio.gather(*(_stream(http, url, key, prefix + [11, i], 24) for i in range(16)))
            samples = []  # (waiting, running) per replica, as the engines last reported them
            while not burst.done():
                text = await _metrics(http, metrics_url)
                samples.append((_per_replica(text, "vllm:num_requests_waiting"),
                                _per_replica(text, "vllm:num_requests_running")))
                await asyncio.sleep(0.05)
            results = await burst

            def idle_while_queued(sample, a, b):
                (waiting, running) = sample
                return waiting.get(a, 0) > 0 and running.get(b, 0) == 0 and waiting.get(b, 0) == 0

            # An engine reports after each step, so a replica busy with its first step of the burst still
            # shows its idle state from before: samples count once both have reported work. And two in a
            # row (50 ms apart, several steps): a report that is a step old is not idleness.
            start = next(i for i, (_, running) in enumerate(samples) if min(running.get(r, 0) for r in ("0", "1")) > 0)
            samples = samples[start:]
            idle = [(x, y) for x, y in zip(samples, samples[1:])
                    if any(idle_while_queued(x, a, b) and idle_while_queued(y, a, b) for a, b in (("0", "1"), ("1", "0")))]
            assert all(r[0] == 200 and r[3] for r in results), results
            after = _per_replica(await _metrics(http, metrics_url), "moegate_decode_tokens_total")
            decoded = {r: after[r] - before.get(r, 0) for r in after}
            # 16 x 23 decode steps. Routing filled both replicas' slots at once (affinity alone would have
            # queued everything on the replica holding the prefix): each decoded at least a full wave. Past
            # that the split follows speed: a replica that drains first takes the other's queued requests.
            assert min(decoded.values()) >= SLOTS * 23, decoded
            assert len(samples) >= 3 and not idle, idle

    asyncio.run(scenario())


def test_batch_lines_spread_over_both_replicas(server):
    """A 24-line batch behind one prefix: the runner keeps twice every replica's slots in flight and the
    router spreads them by load, so both replicas decode a good share; every line is answered."""
    _, key, url, metrics_url = server

    async def scenario():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        prefix = _prefix(1)
        lines = [{"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "demo", "prompt": prefix + [21, i], "max_tokens": 16, "ignore_eos": True}}
                 for i in range(24)]
        async with aiohttp.ClientSession() as http:
            before = _per_replica(await _metrics(http, metrics_url), "moegate_decode_tokens_total")
            f = await client.files.create(file=("in.jsonl", io.BytesIO("\n".join(json.dumps(x) for x in lines).encode())),
                                          purpose="batch")
            batch = await client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
            deadline = time.monotonic() + 90
            while batch.status not in ("completed", "failed", "expired", "cancelled"):
                assert time.monotonic() < deadline, batch.status
                await asyncio.sleep(0.2)
                batch = await client.batches.retrieve(batch.id)
            assert batch.status == "completed" and batch.request_counts.completed == 24, batch
            after = _per_replica(await _metrics(http, metrics_url), "moegate_decode_tokens_total")
        decoded = {r: after[r] - before.get(r, 0) for r in after}
        assert min(decoded.values()) >= 24 * 15 / 4, decoded

    asyncio.run(scenario())


async def _all_ready(http, url: str, timeout_s: float) -> None:
    """Wait until /health says every replica is ready."""
    deadline = time.monotonic() + timeout_s
    while True:
        async with http.get(f"{url}/health") as r:
            body = await r.json()
        if all(x["status"] == "ready" for x in body["replicas"]):
            return
        assert time.monotonic() < deadline, body
        await asyncio.sleep(0.2)


def test_a_silent_replica_gets_no_new_requests_until_it_speaks_again(server):
    """One idle replica's process is frozen (SIGSTOP). Running engines speak every second, so a few seconds
    later /health calls it unresponsive and new requests all go to the other replica at once (none waits for
    the stall timeout); it is not killed (it had no requests), and once it runs again it is ready again."""
    proc, key, url, _ = server

    async def scenario():
        async with aiohttp.ClientSession() as http:
            await _all_ready(http, url, 90)
            frozen = engine_pids(proc.pid)[1]
            os.kill(frozen, signal.SIGSTOP)
            try:
                await asyncio.sleep(4.5)  # past the router's 3 s window
                async with http.get(f"{url}/health") as r:
                    statuses = sorted(x["status"] for x in (await r.json())["replicas"])
                assert statuses == ["ready", "unresponsive"], statuses
                t0 = time.monotonic()
                results = await asyncio.gather(*(_stream(http, url, key, _prefix(5 + i % 2) + [37, i], 4)
                                                  for i in range(8)))
                waited = time.monotonic() - t0
            finally:
                os.kill(frozen, signal.SIGCONT)
            assert all(r[0] == 200 and r[2] is None and r[3] for r in results), results
            assert waited < STALL_S, f"requests waited {waited:.1f} s: some went to the frozen replica"
            await _all_ready(http, url, 30)
            assert frozen in engine_pids(proc.pid)

    asyncio.run(scenario())


def test_a_replica_that_stops_answering_is_cut_off_and_replaced(server):
    """One replica's process is frozen (SIGSTOP: alive, silent). Requests sent to it wait until the stall
    timeout, then run on the other replica: every one completes, none sees an error; the frozen one is
    replaced and both are ready again."""
    proc, key, url, _ = server

    async def scenario():
        async with aiohttp.ClientSession() as http:
            frozen = engine_pids(proc.pid)[0]
            os.kill(frozen, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                results = await asyncio.gather(*(_stream(http, url, key, _prefix(1 + i % 2) + [31, i], 4)
                                                  for i in range(8)))
                waited = time.monotonic() - t0
            finally:
                try:
                    os.kill(frozen, signal.SIGCONT)
                except ProcessLookupError:
                    pass  # the watchdog already killed it, as it should
            assert all(r[0] == 200 and r[2] is None and r[3] for r in results), results
            assert waited >= STALL_S  # some went to the frozen replica and were moved
            await _all_ready(http, url, 60)
            assert frozen not in engine_pids(proc.pid)
        assert any("stopped answering" in line for line in proc.output_tail)

    asyncio.run(scenario())


def test_failover_a_killed_replica_leaves_the_rotation_and_rejoins(server):
    """Both replicas full with a queue each; one is killed. Requests it had not started run on the other
    (every response is a 200; no 5xx), its running streams end with a clean error event after their first
    tokens, new requests keep being served, /health names the replica that is down, and once the
    supervisor has restarted it, /health and /metrics show it up and it takes new prefixes again."""
    proc, key, url, metrics_url = server

    async def scenario():
        async with aiohttp.ClientSession() as http:
            await _all_ready(http, url, 90)  # whatever an earlier test did to the replicas is mended
            pids = engine_pids(proc.pid)
            assert len(pids) == 2, pids
            prefixes = [_prefix(1), _prefix(2)]
            burst = [asyncio.ensure_future(_stream(http, url, key, prefixes[i % 2] + [13, i], 48)) for i in range(16)]
            deadline = time.monotonic() + 30
            while True:  # wait for a queue on both replicas: requests there have not started
                waiting = _per_replica(await _metrics(http, metrics_url), "vllm:num_requests_waiting")
                if len(waiting) == 2 and min(waiting.values()) > 0:
                    break
                assert time.monotonic() < deadline, "no queue formed"
                await asyncio.sleep(0.02)
            os.kill(pids[0], signal.SIGKILL)
            # /health names it until the supervisor's restart is up (an engine process starts in well under a
            # second from the forkserver: look at once, and often).
            deadline = time.monotonic() + 10
            while True:
                async with http.get(f"{url}/health") as r:
                    health = (r.status, await r.json())
                if any(x["status"] != "ready" for x in health[1]["replicas"]) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.01)
            during = [await _stream(http, url, key, prefixes[0] + [17, i], 4) for i in range(3)]
            results = await asyncio.gather(*burst)

            assert all(status == 200 for status, *_ in results + during), results + during  # no 5xx
            assert all(done and error is None for _, _, error, done in during), during
            cut = [r for r in results if r[2] is not None]
            assert len(cut) <= SLOTS, results  # at most the killed replica's running requests
            assert all(chunks >= 1 and error["code"] == "engine_unavailable" for _, chunks, error, _ in cut), cut
            assert sum(1 for r in results if r[3]) >= 16 - SLOTS
            assert health[0] == 200 and sorted(r["status"] for r in health[1]["replicas"]) in (
                ["down", "ready"], ["ready", "starting"]), health
            down = next(r["replica"] for r in health[1]["replicas"] if r["status"] != "ready")

            await _all_ready(http, url, 90)  # the supervisor restarts it
            text = await _metrics(http, metrics_url)
            assert _per_replica(text, "moegate_engine_replica_up") == {"0": 1.0, "1": 1.0}
            # Back in the rotation: two new prefixes, the second sent while the first runs, go one to each replica
            # (nobody holds them: the less loaded replica wins). One new prefix alone proves nothing: a replica
            # that rejoins while the other still has a queue is given queued requests of both burst prefixes,
            # and then the two hold the same prefix families and either may take it.
            before = _per_replica(text, "moegate_prefill_tokens_total")  # a restarted engine counts from 0
            async with http.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                 json={"model": "demo", "prompt": _prefix(4) + [1], "max_tokens": 2000,
                                       "stream": True, "ignore_eos": True}) as held:
                assert held.status == 200, await held.text()
                line = b""
                while not line.startswith(b"data: "):  # its first token: it runs, and counts on its replica
                    line = await held.content.readline()
                    assert line, "the held stream ended before its first token"
                await _complete(http, url, key, _prefix(3) + [1])
                held.close()  # the disconnect aborts it
            after = _per_replica(await _metrics(http, metrics_url), "moegate_prefill_tokens_total")
            assert all(after[r] - before.get(r, 0) >= PREFIX for r in ("0", "1")), (down, before, after)
        retried = [line for line in proc.output_tail if "sending it to another" in line]
        assert retried, "no request was moved off the killed replica"

    asyncio.run(scenario())
