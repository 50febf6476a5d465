"""Data-parallel replicas and the router, side by side in one run:

  1 replica  |  2 replicas, round-robin  |  2 replicas, cache-aware router

    python -m benchmarks.replica_routing [--tenants 16] [--requests 512] [--prefix-tokens 1000] [--json]

The workload is multi-tenant with shared prefixes: each tenant has its own
system prompt of ``--prefix-tokens`` tokens (its KV blocks salted by tenant, as
the gateway salts them), and each request adds a unique 16-48-token suffix
and asks for 8-24 tokens (greedy, EOS ignored). Requests come in a random
tenant order, ``--concurrency`` at a time (closed loop). Each replica's KV pool
is ``--kv-blocks`` blocks of 16 tokens: by default it holds a little more than
half of the tenants' prefixes, so where a replica sees every tenant (one
replica, or round-robin) prefixes evict each other, and where the router keeps
each tenant on one replica they fit.

Each replica is a real engine process (``AsyncEngine``) with one torch
thread; requests go through ``gateway.replica_router.ReplicaRouter``, the
object the gateway's routes call, in this process (no HTTP: what is measured
is the routing and the engines). Cached prompt tokens are the engines' own
counters (prefix hits / prompt tokens looked up), read after the run. The
model is the demo model (random-weight Qwen3-MoE layout, about 8M parameters).
"""

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass

from engine.core.config import EngineConfig
from engine.core.request_policy import RequestPolicy
from engine.core.sampling_params import SamplingParams
from engine.serving.async_engine import AsyncEngine
from gateway.replica_router import ReplicaRouter
from gateway.routing_policy import RouterConfig
from engine.loading.demo_model import write_demo_model


@dataclass(slots=True)
class Request:
    tenant: str
    prompt: list[int]
    max_tokens: int


@dataclass(slots=True)
class ModeResult:
    mode: str
    replicas: int
    seconds: float
    requests: int
    output_tokens: int
    prompt_tokens: int
    cached_prompt_tokens: int  # the engines' prefix hits
    routed: list[int]  # requests per replica
    prefixes_held: list[int]  # tenants' prefixes in each replica's routing index at the end

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def cached_fraction(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def make_workload(tenants: int, requests: int, prefix_tokens: int, seed: int, vocab: int) -> list[Request]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, vocab - 1) for _ in range(prefix_tokens)] for _ in range(tenants)]
    out = []
    for _ in range(requests):
        t = rng.randrange(tenants)
        suffix = [rng.randrange(1, vocab - 1) for _ in range(rng.randint(16, 48))]
        out.append(Request(f"tenant-{t}", prefixes[t] + suffix, rng.randint(8, 24)))
    return out


async def run_mode(mode: str, n: int, policy: str, model: str, reqs: list[Request], args) -> ModeResult:
    config = EngineConfig(model=model, dtype="float32", device="cpu", cpu_threads=1, num_kv_blocks=args.kv_blocks,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    router = ReplicaRouter([AsyncEngine(config) for _ in range(n)], [str(i) for i in range(n)],
                           RouterConfig(policy=policy))
    await router.start()
    try:
        # Warm-up outside the measurement: a request per replica with prompts no tenant shares.
        rng = random.Random(1)
        warm = [[rng.randrange(1, 100) for _ in range(64)] for _ in range(n)]
        await asyncio.gather(*(_one(router, p, 4, f"warm-{i}") for i, p in enumerate(warm)))
        before = [(r.stats.prefix_query_tokens, r.stats.prefix_hit_tokens) for r in router.replicas]
        routed_before = list(router.routed)
        queue = list(reqs)
        outputs = 0

        async def worker() -> None:
            nonlocal outputs
            while queue:
                r = queue.pop(0)
                done = await _one(router, r.prompt, r.max_tokens, r.tenant)
                outputs += done  # after the await: `outputs += await ...` would add to a stale value

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        seconds = time.perf_counter() - t0
        await asyncio.sleep(0.2)  # the engines' last statistics
        query = sum(r.stats.prefix_query_tokens - b[0] for r, b in zip(router.replicas, before))
        hit = sum(r.stats.prefix_hit_tokens - b[1] for r, b in zip(router.replicas, before))
        routed = [a - b for a, b in zip(router.routed, routed_before)]
        # Where each tenant's prefix ended up, by the router's index (a replica holding >= 90% of it).
        prefixes = {r.tenant: r.prompt[:args.prefix_tokens] for r in reqs}
        held = [sorted(t for t, p in prefixes.items()
                       if router.matched_blocks(p, t)[i] * config.block_size >= 0.9 * args.prefix_tokens)
                for i in range(n)]
        return ModeResult(mode, n, seconds, len(reqs), outputs, query, hit, routed, [len(h) for h in held])
    finally:
        await router.shutdown()


async def _one(router: ReplicaRouter, prompt: list[int], max_tokens: int, tenant: str) -> int:
    sampling_params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    n = 0
    policy = RequestPolicy(tenant=tenant, cache_salt=tenant)
    async for out in router.generate(prompt, sampling_params, policy=policy, stream=False):
        n = out.num_output_tokens
    return n


async def main(args) -> list[ModeResult]:
    with tempfile.TemporaryDirectory() as model:
        write_demo_model(model, seed=args.seed)
        with open(f"{model}/config.json") as f:
            vocab = json.load(f)["vocab_size"]
        reqs = make_workload(args.tenants, args.requests, args.prefix_tokens, args.seed, vocab)
        results = []
        for mode, n, policy in (("1 replica", 1, "round-robin"), ("2 replicas, round-robin", 2, "round-robin"),
                                ("2 replicas, cache-aware", 2, "cache-aware")):
            res = await run_mode(mode, n, policy, model, reqs, args)
            results.append(res)
            if not args.json:
                print(f"{res.mode:26s} {res.seconds:7.1f} s  {res.output_tokens_per_s:7.1f} out tok/s  "
                      f"cached {res.cached_fraction:6.1%}  routed {res.routed}  prefixes held {res.prefixes_held}", flush=True)
        return results


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tenants", type=int, default=16)
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--prefix-tokens", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--kv-blocks", type=int, default=600, help="per replica, 16 tokens each")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    results = asyncio.run(main(args))
    one, rr, ca = results
    summary = {"cache_aware_vs_round_robin": ca.output_tokens_per_s / rr.output_tokens_per_s,
               "two_vs_one_replica": ca.output_tokens_per_s / one.output_tokens_per_s,
               "cache_aware_cached_fraction": ca.cached_fraction}
    if args.json:
        print(json.dumps({"modes": [{**asdict(r), "output_tokens_per_s": r.output_tokens_per_s,
                                     "cached_fraction": r.cached_fraction} for r in results], **summary}, indent=1))
    else:
        print(f"cache-aware / round-robin: {summary['cache_aware_vs_round_robin']:.2f}x   "
              f"2 replicas (cache-aware) / 1 replica: {summary['two_vs_one_replica']:.2f}x   "
              f"cache-aware cached prompt tokens: {summary['cache_aware_cached_fraction']:.1%}")
