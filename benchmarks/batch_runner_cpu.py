"""The gateway's CPU per Batch API line, by thread: the whole batch runner against an instant engine.

    python -m benchmarks.batch_runner_cpu [--lines 2000] [--rounds 3] [--max-inflight 64] [--db URL]

Runs ``--rounds`` batches of ``--lines`` lines through the real ``BatchRunner``
and ``BatchStore`` (claims with leases, group-committed result writes with
usage rows, finalizing, and a client's status poll every 20 ms) on a fresh
SQLite file (or ``--db``), with a test double in place of the engine process
that answers each line at once with one final result, as the engine does for
batch lines. What is left is the gateway's own work per line, and this prints
it as CPU milliseconds per line for each thread of the process (the event
loop's, the runner's SQL worker, aiosqlite's), from ``/proc/self/task``.
Each round's batch is created (untimed) on top of the earlier ones, so a cost
that grows with the table shows up round by round; ``--lines 20000`` shows
one that grows with the batch.
"""

import argparse
import asyncio
import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass

from benchmarks import run_on_gateway_loop
from benchmarks.instant_engine import InstantEngine
from engine.core.outputs import RequestOutput


@dataclass
class _Line:
    line_no: int
    custom_id: str
    body_json: str


class _OneResultEngine(InstantEngine):
    """Answers every request with its final delta alone (batch lines are quiet: one message at the end)."""

    async def generate(self, prompt, sampling, request_id=None, **_):
        n = sampling.max_tokens or self.num_tokens
        yield RequestOutput(request_id or "r", [65] * n, "A" * n, True, "length", 12, 0, n)


def _thread_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) of each thread of this process, by Python thread name."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(tid), f"thread {tid}")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


async def _run(args, url: str) -> None:
    from gateway.batch.runner import BatchRunner, BatchRunnerConfig
    from tenants.batch_store import BatchStore
    from tenants.migrate import upgrade
    from tenants.quota import QuotaManager
    from tenants.store import TenantStore

    upgrade(url)
    store = TenantStore.open(url)
    batches = BatchStore(store, QuotaManager(store))
    engine = _OneResultEngine(num_tokens=16)
    await engine.start()
    runner = BatchRunner(batches, engine, lambda: "instant",
                         BatchRunnerConfig(max_inflight=args.max_inflight, poll_s=0.05))
    task = asyncio.create_task(runner.run())
    try:
        tenant = await store.create_tenant(f"bench-{os.getpid()}-{time.time_ns()}")
        body = json.dumps({"model": "instant", "prompt": "mixture of experts routing " * 4, "max_tokens": 16})
        for r in range(args.rounds):
            batch = await batches.create_batch(tenant.id, "/v1/completions", "file-x", 3600, "24h", None, "instant",
                                               [_Line(i + 1, f"c{i}", body) for i in range(args.lines)], None, 0)
            before, cpu0, wall0, writes0 = _thread_cpu_s(), time.process_time(), time.perf_counter(), runner.writes
            runner.wake.set()
            while (await batches.get_batch(tenant.id, batch.id)).status != "completed":
                await asyncio.sleep(0.02)
            wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            after = _thread_cpu_s()
            per_thread = ", ".join(f"{name} {(after[name] - before.get(name, 0.0)) / args.lines * 1e3:.3f}"
                                   for name in sorted(after) if after[name] - before.get(name, 0.0) > 0)
            print(f"round {r}: {args.lines} lines in {wall:.2f} s ({args.lines / wall:.0f} lines/s), "
                  f"{runner.writes - writes0} result writes; CPU {cpu / args.lines * 1e3:.3f} ms/line "
                  f"({per_thread})", flush=True)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await batches.close()
        await store.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lines", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-inflight", type=int, default=64, help="the runner's lines in flight (gateway: 2 x max_num_seqs)")
    p.add_argument("--db", default=None, help="database URL (default: a fresh SQLite file)")
    args = p.parse_args()
    threading.current_thread().name = "event loop"
    with tempfile.TemporaryDirectory() as tmp:
        run_on_gateway_loop(_run(args, args.db or f"sqlite:///{os.path.join(tmp, 'bench.db')}"))


if __name__ == "__main__":
    main()
