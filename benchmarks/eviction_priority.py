"""Eviction that knows priority and tenant (``--kv-eviction-policy``): a realtime tenant's cached system prompt
beside a background flood, under ``priority`` and ``lru``; then what one eviction costs.

    python -m benchmarks.eviction_priority [--block-size 16] [--pool-blocks 192] [--system-len 1024]
                                           [--flood 12] [--flood-len 384] [--rounds 8] [--concurrency 4]

The engine's scheduler and block pool, no model (what is cached does not depend on the weights): each round
the background tenant (class 2) sends ``flood`` distinct prompts, ``concurrency`` at a time, and the realtime
tenant (class 0) then sends its system prompt again, with a new user turn. Printed per policy: the realtime
request's prompt tokens served from cache, as a share of its system prompt, on each repeat (min and mean), the
flood's own cached share, and the pool's evictions. Then the cost of one eviction from a large pool (blocks
of 3 classes and 8 tenants), each policy, microseconds per allocate of a cached block.
"""

import argparse
import random
import time

from engine.core.block_pool import BlockPool
from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.request import Request
from engine.core.request_policy import RequestPolicy
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler

REALTIME = RequestPolicy(priority=0, tenant="realtime", cache_salt="realtime")
BACKGROUND = RequestPolicy(priority=2, tenant="batch", cache_salt="batch", background=True)


def _drain(scheduler: Scheduler, rng: random.Random) -> None:
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        scheduler.update(out, [rng.randrange(1, 30_000) if s.sample else None for s in out.scheduled])


def run(policy: str, args: argparse.Namespace) -> dict:
    rng = random.Random(0)  # the same workload for both policies
    scheduler = Scheduler(SchedulerConfig(args.concurrency + 1, 4096, 8192),
                          CacheConfig(args.block_size, args.pool_blocks, True, eviction_policy=policy))
    system = [rng.randrange(1, 30_000) for _ in range(args.system_len)]
    params = SamplingParams(ignore_eos=True)
    shares, flood_cached, flood_tokens = [], 0, 0
    for r in range(args.rounds + 1):
        turn = [rng.randrange(1, 30_000) for _ in range(24)]
        realtime = Request(f"rt{r}", system + turn, params, max_tokens=8, policy=REALTIME)
        scheduler.add_request(realtime)
        _drain(scheduler, rng)
        if r:
            shares.append(min(realtime.num_cached_tokens, args.system_len) / args.system_len)
        if r == args.rounds:
            break
        flood = [Request(f"f{r}.{i}", [rng.randrange(1, 30_000) for _ in range(args.flood_len)], params,
                         max_tokens=8, policy=BACKGROUND) for i in range(args.flood)]
        for start in range(0, len(flood), args.concurrency):
            for request in flood[start:start + args.concurrency]:
                scheduler.add_request(request)
            _drain(scheduler, rng)
        flood_cached += sum(f.num_cached_tokens for f in flood)
        flood_tokens += sum(f.num_prompt_tokens for f in flood)
    return {"min": min(shares), "mean": sum(shares) / len(shares), "flood": flood_cached / flood_tokens,
            "evictions": scheduler.kv.pool.num_evictions}


def eviction_cost(policy: str, num_blocks: int = 100_000, rounds: int = 200_000) -> float:
    """Microseconds per allocate + release of one block from a pool whose free blocks are all cached."""
    rng = random.Random(0)
    pool = BlockPool(num_blocks, True, policy)
    blocks = pool.allocate(num_blocks)
    for i, block in enumerate(blocks):
        pool.register(block, i.to_bytes(8, "little"), f"t{rng.randrange(8)}", rng.randrange(3))
    pool.release(blocks)
    start = time.perf_counter()
    for i in range(rounds):
        (block,) = pool.allocate(1)
        pool.register(block, (num_blocks + i).to_bytes(8, "little"), f"t{i % 8}", i % 3)
        pool.release([block])
    return (time.perf_counter() - start) / rounds * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--pool-blocks", type=int, default=192)
    parser.add_argument("--system-len", type=int, default=1024)
    parser.add_argument("--flood", type=int, default=12, help="background prompts a round")
    parser.add_argument("--flood-len", type=int, default=384)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4, help="background requests in flight at once")
    args = parser.parse_args()
    print(f"pool {args.pool_blocks} blocks of {args.block_size}; system prompt {args.system_len} tokens "
          f"({args.system_len // args.block_size} blocks); {args.flood} background prompts of {args.flood_len} "
          f"tokens a round, {args.rounds} rounds")
    print(f"{'policy':<9} {'realtime cached share min':>26} {'mean':>7} {'flood cached':>13} {'evictions':>10} "
          f"{'us/eviction':>12}")
    for policy in ("priority", "lru"):
        got = run(policy, args)
        cost = eviction_cost(policy)
        print(f"{policy:<9} {got['min']:>26.1%} {got['mean']:>7.1%} {got['flood']:>13.1%} {got['evictions']:>10} "
              f"{cost:>12.2f}")


if __name__ == "__main__":
    main()
