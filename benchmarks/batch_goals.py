"""The Batch API's two goals, measured side by side in one run on one machine:

  1. live standard traffic's p99 TTFT with a 2,000-request batch running, against the same live
     traffic with no batch (goal: within 1.5x);
  2. with no live traffic, the batch's output tokens/s against the offline engine's
     (``engine.LLM``) on the same requests (goal: 90% or more).

    python -m benchmarks.batch_goals [--batch 2000] [--live-rate 2] [--live-seconds 30] [--rounds 3]
    python -m benchmarks.batch_goals --skip-live --rounds 5 --cpu   # goal 2 only, with CPU per round
    python -m benchmarks.batch_goals --skip-live --pin              # goal 2, the gateway on a core of its own

The server is the real gateway (``create_app``) with its engine process, on
loopback; the model is the demo model (random weights, CPU or GPU). Goal 2's
rounds alternate which side runs first and follow ``--warmup-rounds`` (1)
untimed rounds of both sides; ``--cpu`` adds each round's CPU seconds and
context switches per thread, and every round prints where the batch's time
went (submit, run, finalize, seen by the client's poll). A batch's time is from
the start of its upload to its row's ``completed_at``.
"""

import argparse
import asyncio
import io
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass

import aiohttp

from benchmarks import run_on_gateway_loop


def _requests(n: int, seed: int, max_tokens: int) -> list[dict]:
    rng = random.Random(seed)
    words = "mixture experts routing tokens batch latency gateway tenant cache prefix".split()
    return [{"prompt": " ".join(rng.choice(words) for _ in range(rng.randint(8, 48))), "max_tokens": max_tokens,
             "temperature": 0, "ignore_eos": True} for _ in range(n)]


async def _ttft(http, url: str, key: str, body: dict) -> float:
    t0 = time.perf_counter()
    async with http.post(f"{url}/v1/completions", json={**body, "model": "demo", "stream": True},
                         headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status == 200, await r.text()
        first = None
        async for line in r.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - t0
        return first


async def live_phase(url: str, key: str, rate: float, seconds: float, seed: int) -> list[float]:
    """Poisson live requests for ``seconds``; their TTFTs."""
    rng = random.Random(seed)
    bodies = _requests(int(rate * seconds * 2) + 10, seed, 16)
    async with aiohttp.ClientSession() as http:
        tasks, t = [], 0.0
        start = time.perf_counter()
        for body in bodies:
            t += rng.expovariate(rate)
            if t > seconds:
                break
            await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            tasks.append(asyncio.create_task(_ttft(http, url, key, body)))
        return await asyncio.gather(*tasks)


_clients: dict[tuple[str, str], object] = {}


def _client(url: str, key: str):
    # One client per key (uploads and batch creation): building one loads the CA store (about 40 ms of
    # CPU), and this process also runs the gateway, so a client per batch would steal the CPU measured.
    import openai

    if (url, key) not in _clients:
        _clients[url, key] = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    return _clients[url, key]


async def submit_batch(url: str, key: str, bodies: list[dict]) -> str:
    client = _client(url, key)
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": {**b, "model": "demo"}}
             for i, b in enumerate(bodies)]
    data = ("\n".join(json.dumps(l) for l in lines) + "\n").encode()
    f = await client.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch")
    batch = await client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    return batch.id


@dataclass(frozen=True)
class BatchStatus:
    status: str
    completed: int
    failed: int
    total: int


_status_sessions: list[aiohttp.ClientSession] = []


async def batch_status(url: str, key: str, batch_id: str) -> BatchStatus:
    """``GET /v1/batches/{id}`` with a plain aiohttp session, not the openai client.

    The client runs in the gateway's process, on the cores the engine needs, and the openai client
    took about 4 ms of CPU per call (cProfile); a real client polls from elsewhere. Uploads and batch
    creation still go through the openai client (``submit_batch``).
    """
    if not _status_sessions:
        _status_sessions.append(aiohttp.ClientSession())
    async with _status_sessions[0].get(f"{url}/v1/batches/{batch_id}",
                                       headers={"Authorization": f"Bearer {key}"}) as resp:
        resp.raise_for_status()
        body = await resp.json()
    counts = body.get("request_counts") or {}
    return BatchStatus(body["status"], counts.get("completed", 0), counts.get("failed", 0), counts.get("total", 0))


async def close_status_session() -> None:
    while _status_sessions:
        await _status_sessions.pop().close()


async def wait_completed(url: str, key: str, batch_id: str, poll_s: float | None) -> int:
    """Poll until the batch has completed, as a client would: every ``poll_s``, or (None) at half the time
    the batch's progress so far says is left, between 0.5 and 2 s. Returns how many polls it took.

    The batch's time is read from its row (``timed_batch``), so a late poll does not count against
    it, and polls can be as sparse as a real client's. They were not always: polling until the end
    was seen within 20 ms took 30-70 polls of a 2,000-line batch, each about 4 ms of this process's
    CPU in the openai client and 2.5 ms in the gateway's handler (cProfile), on the cores the engine
    needs, a third as much CPU as the gateway's work for the batch itself.
    """
    polls = 0
    started = time.perf_counter()
    while True:
        status = await batch_status(url, key, batch_id)
        polls += 1
        if status.status == "completed":
            return polls
        if status.status in ("failed", "cancelled", "expired"):
            raise RuntimeError(f"batch {batch_id} ended {status.status}")
        if poll_s is not None:
            await asyncio.sleep(poll_s)
            continue
        # The average rate since the first poll: results are written in waves, so the progress between two
        # close polls says little.
        done, now = status.completed + status.failed, time.perf_counter()
        left_s = (status.total - done) * (now - started) / done if done and status.total else 1.0
        await asyncio.sleep(min(2.0, max(0.5, left_s / 2)))


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


async def start_gateway(tmp: str, engine, tenants: list[str], batch_max_inflight: int | None = None):
    """The real gateway on loopback with a fresh SQLite store in ``tmp``: (aiohttp runner, base URL,
    one API key per tenant). ``runner.cleanup()`` stops it and its engine."""
    from aiohttp import web

    from gateway.app import create_app
    from gateway.config import GatewayConfig
    from tenants.migrate import upgrade
    from tenants.store import TenantStore

    db = f"sqlite:///{os.path.join(tmp, 'policy.db')}"
    upgrade(db)
    store = TenantStore.open(db)
    for name in tenants:
        await store.create_tenant(name)
    keys = [(await store.create_key(name))[1] for name in tenants]
    await store.close()
    app = create_app(GatewayConfig(served_model_name="demo", database_url=db, data_dir=os.path.join(tmp, "data"),
                                   batch_max_inflight=batch_max_inflight), engine)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", keys


async def main_async(args, model_dir: str, tmp: str) -> dict:
    from engine.serving.async_engine import AsyncEngine
    from engine.core.config import EngineConfig

    engine = AsyncEngine(EngineConfig(model=model_dir, **engine_options(args.max_num_seqs, engine_threads(args))))
    # The same live requests run twice, from two tenants: the prefix cache is per tenant, so the second
    # run (beside the batch) gets no cache hits from the first.
    runner, url, (live_key, live2_key, bulk_key) = await start_gateway(tmp, engine, ["live", "live2", "bulk"],
                                                                        args.batch_max_inflight)
    out = {}
    try:
        if args.skip_live:
            await _goal2(args, url, bulk_key, model_dir, engine, out, runner.app)
            return out
        await live_phase(url, live_key, args.live_rate, 3, seed=99)  # warm-up
        alone = await live_phase(url, live_key, args.live_rate, args.live_seconds, seed=1)
        batch_id = await submit_batch(url, bulk_key, _requests(args.batch, 7, args.batch_max_tokens))
        while (await batch_status(url, bulk_key, batch_id)).completed < args.max_num_seqs:
            await asyncio.sleep(0.2)
        beside = await live_phase(url, live2_key, args.live_rate, args.live_seconds, seed=1)
        status = await batch_status(url, bulk_key, batch_id)
        out["live_alone_p99_ttft_ms"] = p99(alone) * 1e3
        out["live_with_batch_p99_ttft_ms"] = p99(beside) * 1e3
        out["live_alone_p50_ttft_ms"] = statistics.median(alone) * 1e3
        out["live_with_batch_p50_ttft_ms"] = statistics.median(beside) * 1e3
        out["ttft_p99_ratio"] = out["live_with_batch_p99_ttft_ms"] / out["live_alone_p99_ttft_ms"]
        out["batch_lines_done_during_live"] = status.completed
        print(f"live p99 TTFT alone {out['live_alone_p99_ttft_ms']:.1f} ms, beside the batch "
              f"{out['live_with_batch_p99_ttft_ms']:.1f} ms: {out['ttft_p99_ratio']:.2f}x (goal <= 1.5x)", flush=True)
        # Let the big batch finish, then time batches with no live traffic at all, each right beside the
        # offline engine on the same requests (while the server idles), so machine noise hits both sides
        # of a ratio alike.
        while (await batch_status(url, bulk_key, batch_id)).status not in ("completed", "failed", "cancelled"):
            await asyncio.sleep(0.5)
        await _goal2(args, url, bulk_key, model_dir, engine, out, runner.app)
    finally:
        await close_status_session()
        await runner.cleanup()
    return out


async def timed_batch(url: str, key: str, bodies: list[dict], max_tokens: int, poll_s: float | None, app) -> dict:
    """Submit ``bodies`` as one batch and wait for it: output tokens/s, status polls, wall s, phases.

    The batch's time runs from the start of the upload to the ``completed_at`` of its row (the output
    file is ready): submit, run and finalize, not the client's ``seen`` (printed with the phases).
    """
    submitted_at = time.time()
    batch_id = await submit_batch(url, key, bodies)
    polls = await wait_completed(url, key, batch_id, poll_s)
    phases = await batch_phases(app, batch_id, submitted_at, time.time())
    elapsed = phases["submit"] + phases["run"] + phases["finalize"]
    return {"batch_output_tok_s": len(bodies) * max_tokens / elapsed, "status_polls": polls, "wall_s": elapsed,
            "phases_s": phases}


async def batch_phases(app, batch_id: str, submitted_at: float, seen_at: float) -> dict[str, float]:
    """Where a batch's wall time went, in seconds, from its row's timestamps (``*_at``: ``time.time()``).

    ``submit``: the upload, validation and insert of the lines, until the batch row existed; ``run``:
    until the last line's result was written and the runner began finalizing; ``finalize``: the
    output file and final status; ``seen``: until the client's poll saw it completed.
    """
    from datetime import timezone

    from gateway.batch.batches import BATCH_STORE

    b = await app[BATCH_STORE].get_batch(None, batch_id)

    def epoch(dt) -> float:
        return dt.replace(tzinfo=timezone.utc).timestamp()

    return {"submit": epoch(b.created_at) - submitted_at, "run": epoch(b.finalizing_at) - epoch(b.created_at),
            "finalize": epoch(b.completed_at) - epoch(b.finalizing_at), "seen": seen_at - epoch(b.completed_at)}


async def _goal2(args, url: str, bulk_key: str, model_dir: str, engine, out: dict, app) -> None:
    """Batches timed with no live traffic at all, each right beside the offline engine on the same requests."""
    offline = await asyncio.to_thread(OfflineEngine, model_dir, args.max_num_seqs, engine_threads(args))
    if args.skip_live:  # warm the served engine too (first-touch of its KV pool), as the live phases otherwise do
        batch_id = await submit_batch(url, bulk_key, _requests(4 * args.max_num_seqs, 5, args.batch_max_tokens))
        while (await batch_status(url, bulk_key, batch_id)).status != "completed":
            await asyncio.sleep(0.1)
    if args.pin:  # every thread of both engines exists by now (torch's pool starts with the first step)
        gateway_cores, engine_cores = pin_gateway_and_engines(engine._process.pid, offline.pid())
        out["pinned"] = {"gateway": sorted(gateway_cores), "engines": sorted(engine_cores)}
        print(f"pinned: the gateway on cores {sorted(gateway_cores)}, each engine (one at a time) on "
              f"{sorted(engine_cores)} with {len(engine_cores)} torch threads", flush=True)
    for w in range(args.warmup_rounds):
        # Untimed, both sides at full size: without it the first timed round had the lowest ratio in 8 of
        # 10 runs, and with the order swapped both sides were at their slowest in it (docs/performance.md).
        bodies = _requests(args.throughput_batch, 900 + w, args.batch_max_tokens)
        batch_tok_s = (await timed_batch(url, bulk_key, bodies, args.batch_max_tokens, args.poll_s,
                                         app))["batch_output_tok_s"]
        offline_tok_s = (await offline.throughput(bodies))[0]
        out.setdefault("warmup_rounds", []).append({"batch_output_tok_s": batch_tok_s,
                                                    "offline_output_tok_s": offline_tok_s})
        print(f"warm-up round {w} (not counted): batch alone {batch_tok_s:.0f} tok/s vs offline engine "
              f"{offline_tok_s:.0f} tok/s: {batch_tok_s / offline_tok_s:.0%}", flush=True)
    out["rounds"] = []
    profile = None
    if args.profile:
        import cProfile

        profile = cProfile.Profile(time.thread_time)  # CPU of the event loop thread, not wall time
    for r in range(args.rounds):
        bodies = _requests(args.throughput_batch, 11 + r, args.batch_max_tokens)  # fresh prompts: no cache hits
        # Odd rounds run the offline engine first: a drift in this shared machine's speed over a round
        # (half a minute) then favours neither side.
        offline_first = (r + args.offline_first_round0) % 2 == 1
        if offline_first:
            offline_tok_s, offline_wall_s, offline_cpu_s = await offline.throughput(bodies)
        cpu0 = cpu_times(engine) if args.cpu else None
        if profile:
            profile.enable()
        row = await timed_batch(url, bulk_key, bodies, args.batch_max_tokens, args.poll_s, app)
        if profile:
            profile.disable()
        batch_tok_s, elapsed = row["batch_output_tok_s"], row["wall_s"]
        if args.cpu:
            row["cpu_s"] = {k: v - cpu0.get(k, 0.0) for k, v in cpu_times(engine).items()}
        if not offline_first:
            offline_tok_s, offline_wall_s, offline_cpu_s = await offline.throughput(bodies)
        row.update(offline_output_tok_s=offline_tok_s, batch_vs_offline=batch_tok_s / offline_tok_s)
        out["rounds"].append(row)
        print(f"round {r}: batch alone {batch_tok_s:.0f} tok/s vs offline engine {offline_tok_s:.0f} tok/s: "
              f"{batch_tok_s / offline_tok_s:.0%} (goal >= 90%); batch phases, s: "
              + ", ".join(f"{k} {v:.3f}" for k, v in row["phases_s"].items())
              + f" ({row['status_polls']} polls); offline engine {offline_wall_s:.3f} s", flush=True)
        if args.cpu:
            row["offline_cpu_s"] = offline_cpu_s
            row["offline_wakeups"], row["offline_preempted"] = offline.last_context_switches
            print(f"  CPU s in {elapsed + row['phases_s']['seen']:.2f} s (until seen): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in sorted(row["cpu_s"].items()))
                  + f"; offline engine {offline_cpu_s:.2f} in {offline_wall_s:.2f} s, "
                  f"wakeups {row['offline_wakeups']}, preempted {row['offline_preempted']}", flush=True)
    ratios = [x["batch_vs_offline"] for x in out["rounds"]]
    out["batch_vs_offline"] = statistics.median(ratios)
    out["batch_vs_offline_range"] = [min(ratios), max(ratios)]
    offline.close()
    if profile:
        profile.dump_stats(args.profile)


def pin_split() -> tuple[set[int], set[int]]:
    """(the gateway's cores, the engines' cores): the first core this process may use, and the rest."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--pin needs at least 2 cores")
    return {cores[0]}, set(cores[1:])


def pin_gateway_and_engines(*engine_pids: int) -> tuple[set[int], set[int]]:
    """This process (the gateway) on its core, the engines' processes on the others (``pin_split``)."""
    gateway_cores, engine_cores = pin_split()
    for pid in engine_pids:
        pin_process(pid, engine_cores)
    pin_process(os.getpid(), gateway_cores)
    return gateway_cores, engine_cores


def engine_threads(args) -> int | None:
    """Torch threads of both engines: with --pin, one per engine core (so neither switches)."""
    return len(pin_split()[1]) if args.pin else args.cpu_threads


def pin_process(pid: int, cores: set[int]) -> None:
    """Every thread of ``pid`` onto ``cores`` (threads it starts later inherit the mask of their creator)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, FileNotFoundError):  # the thread ended meanwhile
            pass


def _thread_cpu_s(pid: int, names: dict[int, str] | None = None) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of a process, summed by thread name (Linux /proc).

    ``names``: native thread id -> name, for threads whose OS name says nothing (Python's threads).
    """
    names = names or {}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        name = names.get(int(tid)) or stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def thread_switches(pid: int, names: dict[int, str] | None = None) -> dict[str, tuple[int, int]]:
    """(voluntary, involuntary) context switches of each thread of a process so far, summed by thread
    name (``names`` as in ``_thread_cpu_s``; Linux /proc).

    A thread's voluntary switches count its waits, so about its wakeups; an engine thread's
    involuntary ones count the times another thread took its core.
    """
    names = names or {}
    out: dict[str, tuple[int, int]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if "ctxt_switches" in line or line.startswith("Name:"))
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        name = names.get(int(tid)) or fields["Name"].strip()
        vol, invol = out.get(name, (0, 0))
        out[name] = (vol + int(fields["voluntary_ctxt_switches"]), invol + int(fields["nonvoluntary_ctxt_switches"]))
    return out


def context_switches(pid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of all threads of a process so far."""
    per_thread = thread_switches(pid).values()
    return sum(v for v, _ in per_thread), sum(i for _, i in per_thread)


def cpu_times(engine) -> dict[str, float]:
    """CPU seconds so far: the gateway process (this one) by thread name, the engine process in all;
    and both processes' context switches ("...:wakeups" voluntary, "...:preempted" involuntary)."""
    import re
    import threading

    # Python's thread names, numbers folded ("asyncio_3" and "Thread-7 (...)" are pools of one kind).
    names = {t.native_id: re.sub(r"[-_ ]?\d+", "", t.name) for t in threading.enumerate()}
    out = {f"gateway:{k}": v for k, v in _thread_cpu_s(os.getpid(), names).items()}
    out["gateway"] = sum(out.values())
    out["engine"] = sum(_thread_cpu_s(engine._process.pid).values())
    gateway_threads = thread_switches(os.getpid(), names)
    out.update({f"gateway:{k}:wakeups": v for k, (v, _) in gateway_threads.items()})
    out["gateway:wakeups"] = sum(v for v, _ in gateway_threads.values())
    out["gateway:preempted"] = sum(i for _, i in gateway_threads.values())
    out["engine:wakeups"], out["engine:preempted"] = context_switches(engine._process.pid)
    out["engine:messages"] = getattr(engine, "messages_received", -1)
    return out


_llm = None  # the offline engine, in its worker process


def engine_options(max_num_seqs: int, cpu_threads: int | None) -> dict:
    """EngineConfig fields both engines get, the served one and the offline one."""
    import torch

    options = {"max_num_seqs": max_num_seqs, "cpu_threads": cpu_threads}
    if torch.cuda.is_available():
        # Both engines live on one GPU (never busy at once): each gets a fixed KV pool, where sizing by
        # gpu_memory_utilization would leave the second one only what the first left free.
        options["num_kv_blocks"] = 16384
    return options


def _load_offline_engine(model_dir: str, max_num_seqs: int, cpu_threads: int | None) -> int:
    from engine import LLM

    global _llm
    _llm = LLM(model=model_dir, **engine_options(max_num_seqs, cpu_threads))
    _offline_tok_s(_requests(4 * max_num_seqs, 5, 16))  # warm-up: first-touch of the KV pool, allocator
    return os.getpid()


def _offline_tok_s(bodies: list[dict]) -> tuple[float, float, float]:
    """(output tokens/s, wall s, CPU s of the offline engine's process) for these requests."""
    from engine import SamplingParams

    t0, c0 = time.perf_counter(), time.process_time()
    outs = _llm.generate([b["prompt"] for b in bodies],
                         [SamplingParams(max_tokens=b["max_tokens"], temperature=0, ignore_eos=True) for b in bodies])
    wall = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / wall, wall, time.process_time() - c0


class OfflineEngine:
    """``engine.LLM`` in a process of its own, stepping on its main thread as the engine process does.

    (In a second thread of this process its torch thread pool competes with the first one's: it
    measured about half as fast, which would flatter the batch path.)
    """

    def __init__(self, model_dir: str, max_num_seqs: int, cpu_threads: int | None = None) -> None:
        import concurrent.futures
        import multiprocessing

        self.pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        self._pid = self.pool.submit(_load_offline_engine, model_dir, max_num_seqs, cpu_threads).result()

    def pid(self) -> int:
        return self._pid

    async def throughput(self, bodies: list[dict]) -> tuple[float, float, float]:
        """``LLM.generate`` on these requests (everything queued at once): output tokens/s, wall s, CPU s."""
        before = context_switches(self._pid)
        result = await asyncio.wrap_future(self.pool.submit(_offline_tok_s, bodies))
        self.last_context_switches = tuple(b - a for a, b in zip(before, context_switches(self._pid)))
        return result

    def close(self) -> None:
        self.pool.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=2000, help="lines in the batch that runs beside live traffic")
    p.add_argument("--throughput-batch", type=int, default=2000,
                   help="lines in each batch timed alone (as many as the issue's batch: the upload, validation "
                        "and finalizing are fixed costs of a batch, and a small one magnifies them)")
    p.add_argument("--poll-s", type=float, default=None,
                   help="status poll interval while timing a batch alone (default: half the estimated time left, 0.5 to 2 s)")
    p.add_argument("--rounds", type=int, default=3, help="batch-alone vs offline pairs, each side by side")
    p.add_argument("--batch-max-tokens", type=int, default=16)
    p.add_argument("--live-rate", type=float, default=2.0, help="live requests/s (Poisson)")
    p.add_argument("--live-seconds", type=float, default=30.0)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--batch-max-inflight", type=int, default=None, help="default: the gateway's (2 x max-num-seqs)")
    p.add_argument("--cpu-threads", type=int, default=None, help="the engine's (default: the engine process's)")
    p.add_argument("--profile", metavar="PATH", help="cProfile the gateway's thread during the timed batches")
    p.add_argument("--skip-live", action="store_true", help="goal 2 only: no live phases and no big batch")
    p.add_argument("--offline-first-round0", type=int, choices=(0, 1), default=0,
                   help="1: even rounds run the offline engine first (default: odd rounds)")
    p.add_argument("--warmup-rounds", type=int, default=1,
                   help="untimed full-size rounds of both sides before the timed ones")
    p.add_argument("--cpu", action="store_true", help="per round: CPU seconds of the gateway's threads and the engine")
    p.add_argument("--pin", action="store_true",
                   help="goal 2 with the gateway on a core of its own (as on a GPU machine): this process on the "
                        "first core, both engines on the others with a torch thread per core (Linux)")
    args = p.parse_args()
    if args.pin and not args.skip_live:
        p.error("--pin measures goal 2 only: add --skip-live "
                "(pinned engines would change what the live phases measure)")
    from engine.loading.demo_model import write_demo_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "demo")
        write_demo_model(model_dir, seed=0)
        results = run_on_gateway_loop(main_async(args, model_dir, tmp))
    live = "" if args.skip_live else f"live p99 TTFT ratio {results['ttft_p99_ratio']:.2f}x (goal <= 1.5x); "
    print(f"{live}batch / offline, median of {args.rounds}: {results['batch_vs_offline']:.0%} (goal >= 90%)")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
