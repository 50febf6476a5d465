"""Tenant weights over a fleet of two real engine replicas (4 sequences each) behind the router.

Two tenants of weights 1 and 3 stay backlogged; the reference is the client's own count of the tokens each one
receives, by arrival time, over a window while both have requests waiting (warm-up excluded).
The weighted tenant must be served 3.0 times the tokens (within 5%) both when the router spreads their prompts
and when each tenant's prompts are cached on one replica only (each tenant's system prompt warmed on its own
replica first, so affinity alone would keep them apart). Without fleet fairness the same scenario is served
anywhere from 0.7 to 4.1 (whether the first burst's queues stay apart or mix depends on its timing), so it is no
control here: ``test_fleet_fairness.py`` shows the failure exactly, on replica doubles.
"""

import asyncio
import itertools
import random
import time

import pytest

from engine.core.config import EngineConfig
from engine.core.request_policy import RequestPolicy
from engine.core.sampling_params import SamplingParams
from engine.serving.async_engine import AsyncEngine
from gateway.replica_router import ReplicaRouter
from gateway.routing_policy import RouterConfig
from tests.hf_models import make_hf_model

pytestmark = pytest.mark.timeout(120)

VOCAB = 211
BS = 8  # block size
SLOTS = 4  # max_num_seqs of each replica
SYSTEM = 3 * BS  # a tenant's system prompt: 3 full blocks
OUTPUT = 4  # tokens per request: short, so that slots turn over often and shares settle within the window
WARM_TURNS = 4
CLIENTS = 10  # per tenant, each sending its next request when its last is answered
# The window: until WINDOW_TOKENS output tokens have come (the fair queue's error is bounded, about one request's
# cost a tenant, so it shrinks as the window grows; counted in tokens, it does not depend on the machine's speed),
# or WINDOW_S at most.
WINDOW_TOKENS = 1200
WINDOW_S = 12.0


async def _served(router: ReplicaRouter, affinity: bool, rng: random.Random, window_tokens: int) -> dict[str, int]:
    """Per tenant, output tokens received within the window while both tenants were backlogged."""
    salt = f"{rng.random()}"  # fresh tenants: no replica holds their blocks yet
    weights = {"light": 1.0, "heavy": 3.0}
    policies = {t: RequestPolicy(tenant=t + salt, weight=w, cache_salt=t + salt) for t, w in weights.items()}
    system = {t: [rng.randrange(1, VOCAB - 1) for _ in range(SYSTEM)] for t in weights}
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT, ignore_eos=True)

    def prompt(tenant: str) -> list[int]:
        tail = [rng.randrange(1, VOCAB - 1) for _ in range(3)]
        return system[tenant] + tail if affinity else tail  # mixed: under one block, so no replica is preferred

    if affinity:
        # Each tenant's system prompt cached on its own replica: the first goes to either, the second to the replica
        # without a prompt family (routing_policy's rule for a new prefix); from then on affinity keeps them apart.
        placed = []
        for tenant in weights:
            before = list(router.routed)
            async for _ in router.generate(prompt(tenant), params, f"warm-{tenant}{salt}", policies[tenant]):
                pass
            placed += [i for i, (was, now) in enumerate(zip(before, router.routed)) if now > was]
        assert sorted(placed) == [0, 1], placed

    arrivals: list[tuple[float, str, int]] = []  # (time, tenant, tokens) of every output received
    finished = {t: 0 for t in weights}
    # Warm: the fleet's slots have turned over WARM_TURNS times. The first requests go out as they come (nothing
    # waits yet: half each), and the weighted tenant then catches up; its system prompt's first miss on the other
    # replica (affinity) is behind too.
    warm = asyncio.Event()
    ids = itertools.count()

    async def client(tenant: str) -> None:
        """One of a tenant's clients: a request, then the next as soon as it is answered, until cancelled."""
        while True:
            async for out in router.generate(prompt(tenant), params, f"{tenant}{salt}-{next(ids)}", policies[tenant]):
                arrivals.append((time.monotonic(), tenant, len(out.token_ids)))
                if out.finished:
                    finished[tenant] += 1
                    if sum(finished.values()) >= WARM_TURNS * 2 * SLOTS:
                        warm.set()

    # Closed loop, the same number of clients each: more than the fleet's slots, so both tenants always have
    # requests waiting. Without the fair queue each tenant's queue then stays on its cached replica (equal queues:
    # routing_policy's balance rule sees nothing to even out).
    # Their first requests arrive in turns, as two steady tenants' would.
    tasks = [asyncio.create_task(client(t)) for _ in range(CLIENTS) for t in weights]
    try:
        await asyncio.wait_for(warm.wait(), 30)
        start, first = time.monotonic(), len(arrivals)
        while sum(n for _, _, n in arrivals[first:]) < window_tokens and time.monotonic() < start + WINDOW_S:
            await asyncio.sleep(0.01)
        end = time.monotonic()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    served = {t: sum(n for at, who, n in arrivals if who == t and start <= at < end) for t in weights}
    assert sum(served.values()) >= window_tokens * 0.9, (served, "the window timed out")
    return served


async def _ratio(engines, affinity: bool, window_tokens: int = WINDOW_TOKENS) -> tuple[float, dict[str, int]]:
    router = ReplicaRouter(engines, ["0", "1"], RouterConfig(fleet_fairness=True))  # over started engines
    t0 = time.monotonic()
    served = await _served(router, affinity, random.Random(), window_tokens)
    print(f"affinity {affinity}: {served} in {time.monotonic() - t0:.1f} s")
    return served["heavy"] / served["light"], served


def test_weights_hold_over_two_replicas_mixed_and_under_affinity(tmp_path):
    path = str(tmp_path / "model")
    make_hf_model("qwen3_moe", path, seed=random.randrange(1 << 30), vocab_size=VOCAB)
    config = EngineConfig(model=path, dtype="float32", device="cpu", block_size=BS, num_kv_blocks=256,
                          max_num_seqs=SLOTS, cpu_threads=1)

    async def scenarios() -> None:
        engines = [AsyncEngine(config) for _ in range(2)]
        try:
            t0 = time.monotonic()
            await asyncio.gather(*(e.start() for e in engines))
            print(f"started in {time.monotonic() - t0:.1f} s")
            mixed, served = await _ratio(engines, affinity=False)
            assert 2.85 <= mixed <= 3.15, served
            cached, served = await _ratio(engines, affinity=True)
            assert 2.85 <= cached <= 3.15, served
            print(f"heavy/light served tokens: mixed {mixed:.3f}, cached apart {cached:.3f}")
        finally:
            await asyncio.gather(*(e.shutdown() for e in engines))

    asyncio.run(scenarios())
