"""CPU per batch line of the database work the batch runner does, one kind of call at a time.

    python -m benchmarks.batch_store_cpu [--lines 400] [--claim 64] [--group 32] [--rounds 5] [--db URL]

Runs, on a fresh SQLite file (or ``--db``), what one 400-line batch costs the
gateway in ``BatchStore`` calls: claims of ``--claim`` lines, result writes of
``--group`` lines (``finish_many``, with a usage row each), the runner's
``ready_to_finalize`` check after each write, and status reads (``get_batch``).
Each kind is timed on its own with ``time.process_time`` (every thread of this
process: the event loop's and aiosqlite's, where SQLite itself runs) and
``time.thread_time`` (the event loop's alone), so the numbers are the
gateway's CPU, not wall time: milliseconds per line, and per call.
No engine is involved.
"""

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass


@dataclass
class _Line:
    line_no: int
    custom_id: str
    body_json: str


def _result(custom_id: str, i: int) -> dict:
    # The shape of a real completion line (about 600 bytes of JSON).
    return {"id": f"batch_req_{i:024x}", "custom_id": custom_id, "error": None, "response": {
        "status_code": 200, "request_id": f"batch_req_{i:024x}", "body": {
            "id": f"batch_req_{i:024x}", "object": "text_completion", "created": 1_700_000_000, "model": "demo",
            "choices": [{"index": 0, "text": " tokens routing" * 8, "logprobs": None, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 30, "completion_tokens": 16, "total_tokens": 46,
                      "prompt_tokens_details": {"cached_tokens": 0}}}}}


async def _one_round(bs, store, tenant_id: int, args, timings: dict) -> None:
    from tenants.batch_store import FinishedLine
    from tenants.store import UsageRecord

    body = json.dumps({"prompt": "mixture experts routing " * 8, "max_tokens": 16, "model": "demo"})
    lines = [_Line(i + 1, f"r{i}", body) for i in range(args.lines)]
    batch = await bs.create_batch(tenant_id, "/v1/completions", "file-x", 3600, "24h", None, "demo", lines, None, 0)

    async def timed(kind: str, coro):
        t0, l0 = time.process_time(), time.thread_time()
        out = await coro
        timings.setdefault(kind, []).append(time.process_time() - t0)
        timings.setdefault(kind + "@loop", []).append(time.thread_time() - l0)
        return out

    while True:
        claimed = await timed("claim", bs.claim("bench", args.claim, 60.0))
        if not claimed:
            break
        for k in range(0, len(claimed), args.group):
            group = claimed[k:k + args.group]
            items = [FinishedLine(line, True, _result(line.custom_id, line.id),
                                  UsageRecord(tenant_id, f"req-{line.id}", "demo", 30, 16, batch=True))
                     for line in group]
            written = await timed("finish_many", bs.finish_many("bench", items))
            assert all(written)
            await timed("ready_to_finalize", bs.ready_to_finalize())
            await timed("get_batch", bs.get_batch(tenant_id, batch.id))
    got = await bs.get_batch(tenant_id, batch.id)
    assert got.completed == args.lines, (got.completed, args.lines)


async def main_async(args, url: str) -> dict:
    from tenants.batch_store import BatchStore
    from tenants.migrate import upgrade
    from tenants.quota import QuotaManager
    from tenants.store import TenantStore

    upgrade(url)
    store = TenantStore.open(url)
    try:
        tenant = await store.create_tenant(f"bench-{os.getpid()}-{time.time_ns()}")
        bs = BatchStore(store, QuotaManager(store))
        totals = []
        for r in range(args.rounds + 1):  # the first round warms caches (statement cache, connections)
            timings: dict[str, list[float]] = {}
            await _one_round(bs, store, tenant.id, args, timings)
            if r:
                totals.append({k: sum(v) for k, v in timings.items()} | {"calls": {k: len(v) for k, v in timings.items()}})
        await bs.close()
    finally:
        await store.close()
    out = {}
    for kind in ("claim", "finish_many", "ready_to_finalize", "get_batch"):
        per_round = [t[kind] for t in totals]
        calls = totals[0]["calls"][kind]
        loop = statistics.median(t[kind + "@loop"] for t in totals)
        out[kind] = {"ms_per_line": statistics.median(per_round) / args.lines * 1e3,
                     "ms_per_call": statistics.median(per_round) / calls * 1e3, "calls": calls,
                     "loop_ms_per_line": loop / args.lines * 1e3}
    out["all_ms_per_line"] = sum(v["ms_per_line"] for v in out.values())
    out["all_loop_ms_per_line"] = sum(v["loop_ms_per_line"] for v in out.values() if isinstance(v, dict))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lines", type=int, default=400)
    p.add_argument("--claim", type=int, default=64, help="lines per claim (the runner's free room)")
    p.add_argument("--group", type=int, default=32, help="lines per result write (a wave finishing together)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--db", default=None, help="database URL (default: a fresh SQLite file)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = args.db or f"sqlite:///{os.path.join(tmp, 'bench.db')}"
        res = asyncio.run(main_async(args, url))
    for kind, v in res.items():
        if isinstance(v, dict):
            print(f"{kind:>18}: {v['ms_per_line']:.3f} ms CPU per line, {v['loop_ms_per_line']:.3f} of it on the event "
                  f"loop's thread ({v['ms_per_call']:.2f} ms per call, {v['calls']} calls per batch)")
    print(f"{'all':>18}: {res['all_ms_per_line']:.3f} ms CPU per line, {res['all_loop_ms_per_line']:.3f} of it on the "
          f"event loop's thread")


if __name__ == "__main__":
    main()
