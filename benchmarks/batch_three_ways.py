"""Goal 2 of the Batch API split three ways, in short alternating chunks so a drifting machine cancels out.

    python -m benchmarks.batch_three_ways [--chunks 8] [--lines 500] [--pin]

Each chunk runs ``--lines`` fresh requests (16 output tokens each) three ways,
in a rotating order, and prints output tokens/s for each:

- ``http``: a Batch API batch through the real gateway (upload, validation, the
  runner's claims and result writes on SQLite, finalizing), polled as a client
  would (``batch_goals.wait_completed``), timed from the upload to the batch
  row's ``completed_at`` — what goal 2 measures;
- ``bare``: the same requests sent straight to the served engine process by an
  ``AsyncEngine`` client in the gateway's process, 64 in flight and with the
  batch lines' flags (background, preemptible, batch rank, a cache salt): the
  engine process and the feeding pattern without HTTP or the database;
- ``offline``: ``engine.LLM`` in a process of its own, everything queued at once.

``batch_goals`` alternates a whole 2,000-line batch with the offline engine;
on a machine whose speed drifts by a third over a minute that leaves a round's
ratio at the mercy of the drift. Here a chunk of all three takes about 30 s
on a 2-core VM, and the paired ratios are per chunk.

``--pin`` puts the gateway's process on the first core and both engines on the
others with a torch thread per core: the gateway then has a core of its own,
as on a GPU machine, so the numbers show the batch path's own cost apart from
sharing cores with the engine.
"""

import argparse
import asyncio
import os
import statistics
import tempfile
import time

from benchmarks import run_on_gateway_loop
from benchmarks.batch_goals import (
    OfflineEngine, _requests, close_status_session, engine_options, pin_gateway_and_engines, pin_split, start_gateway,
    timed_batch,
)

MAX_TOKENS = 16


async def bare_tok_s(engine, bodies: list[dict], inflight: int = 64) -> float:
    from engine.core.request_policy import RequestPolicy
    from engine.core.sampling_params import SamplingParams

    slots = asyncio.Semaphore(inflight)

    async def one(i: int, body: dict) -> int:
        async with slots:
            tokens = 0
            prompt = await engine.prepare(body["prompt"])
            async for delta in engine.generate(
                prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                f"bare-{time.monotonic_ns()}-{i}",
                RequestPolicy(priority=2, tenant="bulk", preemptible=True, background=True, cache_salt="bulk"),
                stream=False,
            ):
                tokens = delta.num_output_tokens
            return tokens

    t0 = time.perf_counter()
    tokens = await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))
    return sum(tokens) / (time.perf_counter() - t0)


async def run(args, tmp: str) -> dict[str, list[float]]:
    from engine.serving.async_engine import AsyncEngine
    from engine.core.config import EngineConfig
    from engine.loading.demo_model import write_demo_model

    model_dir = os.path.join(tmp, "demo")
    write_demo_model(model_dir, seed=0)
    threads = len(pin_split()[1]) if args.pin else None
    engine = AsyncEngine(EngineConfig(model=model_dir, **engine_options(args.max_num_seqs, threads)))
    runner, url, (key,) = await start_gateway(tmp, engine, ["bulk"])
    offline = await asyncio.to_thread(OfflineEngine, model_dir, args.max_num_seqs, threads)
    try:
        # warm-up of both paths
        await timed_batch(url, key, _requests(4 * args.max_num_seqs, 5, MAX_TOKENS), MAX_TOKENS, None, runner.app)
        await bare_tok_s(engine, _requests(4 * args.max_num_seqs, 6, MAX_TOKENS))
        if args.pin:  # every engine thread exists by now
            pin_gateway_and_engines(engine._process.pid, offline.pid())
        ways = ["http", "bare", "offline"]
        tok_s: dict[str, list[float]] = {w: [] for w in ways}
        for i in range(args.chunks):
            order = ways[i % 3:] + ways[:i % 3]  # each way goes first, second and last in turn
            if i % 2:
                order.reverse()
            for j, way in enumerate(order):
                bodies = _requests(args.lines, 5000 + 3 * i + j, MAX_TOKENS)  # fresh prompts: no cache hits
                if way == "http":
                    timed = await timed_batch(url, key, bodies, MAX_TOKENS, None, runner.app)
                    tok_s[way].append(timed["batch_output_tok_s"])
                    phases = timed["phases_s"]
                elif way == "bare":
                    tok_s[way].append(await bare_tok_s(engine, bodies))
                else:
                    tok_s[way].append((await offline.throughput(bodies))[0])
            print(f"chunk {i}: " + ", ".join(f"{w} {tok_s[w][-1]:.0f}" for w in ways) + " tok/s; http phases, s: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()), flush=True)
        return tok_s
    finally:
        offline.close()
        await close_status_session()
        await runner.cleanup()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--lines", type=int, default=500, help="requests per chunk and way")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--pin", action="store_true", help="the gateway on a core of its own (Linux, 2 cores or more)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tok_s = run_on_gateway_loop(run(args, tmp))
    for a, b in (("http", "offline"), ("bare", "offline"), ("http", "bare")):
        paired = [x / y for x, y in zip(tok_s[a], tok_s[b])]
        print(f"{a} / {b}: per chunk {', '.join(f'{r:.0%}' for r in paired)}; median {statistics.median(paired):.1%}, "
              f"ratio of the means {sum(tok_s[a]) / sum(tok_s[b]):.1%}")


if __name__ == "__main__":
    main()
