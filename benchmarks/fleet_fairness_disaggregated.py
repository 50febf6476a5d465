"""Tenant weights through one prefill and one decode engine, with and without the fleet's fair queue:

    python -m benchmarks.fleet_fairness_disaggregated [--clients 6] [--window-tokens 800]

Two tenants of weights 1 and 3, ``--clients`` closed-loop clients each, 33-token prompts (computed by the prefill
engine: the decode engine's ``local_prefill_tokens`` is one block, and conditional disaggregation is off) and 4
output tokens a request. The decode engine runs 4 sequences. Output tokens are counted by the client, by arrival
time, over a window of ``--window-tokens`` after 32 requests have finished; the engines are real processes
(``AsyncEngine``, one torch thread, a random tiny MoE checkpoint) behind ``gateway.disaggregation``'s router, in
this process. Prints the heavy/light ratio (the weights ask for 3.0), the KV transfers and the prompt tokens each
engine computed.
"""

import argparse
import asyncio
import collections
import itertools
import random
import tempfile
import time

from engine.core.config import EngineConfig
from engine.core.request_policy import RequestPolicy
from engine.core.sampling_params import SamplingParams
from engine.serving.async_engine import AsyncEngine
from gateway.disaggregation import DisaggregatedEngines


async def measure(path: str, fleet_fairness: bool, clients: int, window_tokens: int) -> dict:
    def config(**extra) -> EngineConfig:
        return EngineConfig(model=path, dtype="float32", device="cpu", block_size=8, num_kv_blocks=256,
                            max_num_seqs=4, cpu_threads=1, **extra)

    prefill = AsyncEngine(config(role="prefill"))
    decode = AsyncEngine(config(role="decode", local_prefill_tokens=8, prefill_queue_tokens=0))
    router = DisaggregatedEngines([prefill], [decode], fleet_fairness=fleet_fairness)
    await router.start()
    rng = random.Random()
    policies = {t: RequestPolicy(tenant=t, weight=w, cache_salt=t) for t, w in (("light", 1.0), ("heavy", 3.0))}
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    arrivals: list[tuple[float, str, int]] = []
    finished = collections.Counter()
    ids = itertools.count()
    warm = asyncio.Event()

    async def client(tenant: str) -> None:
        while True:
            prompt = [rng.randrange(1, 200) for _ in range(33)]
            async for out in router.generate(prompt, params, f"{tenant}-{next(ids)}", policies[tenant]):
                arrivals.append((time.monotonic(), tenant, len(out.token_ids)))
                if out.finished:
                    finished[tenant] += 1
                    if sum(finished.values()) >= 32:
                        warm.set()

    tasks = [asyncio.create_task(client(t)) for _ in range(clients) for t in policies]
    try:
        await asyncio.wait_for(warm.wait(), 120)
        start, first = time.monotonic(), len(arrivals)
        while sum(n for _, _, n in arrivals[first:]) < window_tokens and time.monotonic() < start + 120:
            await asyncio.sleep(0.01)
        end = time.monotonic()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        served = {t: sum(n for at, who, n in arrivals if who == t and start <= at < end) for t in policies}
        result = {"fleet_fairness": fleet_fairness, "served": served, "ratio": served["heavy"] / served["light"],
                  "window_s": end - start, "kv_transfers": decode.stats.kv_transfers,
                  "prefill_engine_prompt_tokens": prefill.stats.total_prefill_tokens,
                  "decode_engine_prompt_tokens": decode.stats.total_prefill_tokens}
        await router.shutdown()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=6, help="closed-loop clients per tenant")
    p.add_argument("--window-tokens", type=int, default=800, help="output tokens counted")
    args = p.parse_args()
    from tests.hf_models import make_hf_model

    with tempfile.TemporaryDirectory() as root:
        make_hf_model("qwen3_moe", root, seed=random.randrange(1 << 30), vocab_size=211)
        for fleet_fairness in (True, False):
            r = asyncio.run(measure(root, fleet_fairness, args.clients, args.window_tokens))
            print(f"fleet fairness {'on ' if fleet_fairness else 'off'}: heavy/light {r['ratio']:.3f} {r['served']} "
                  f"over {r['window_s']:.1f} s; {r['kv_transfers']} KV transfers, prompt tokens computed by the "
                  f"prefill engine {r['prefill_engine_prompt_tokens']}, by the decode engine "
                  f"{r['decode_engine_prompt_tokens']}")


if __name__ == "__main__":
    main()
