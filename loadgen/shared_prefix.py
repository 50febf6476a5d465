"""Shared-prefix workload: many requests behind one long system prompt, prefix cache on vs off.

256 requests share a 1,024-token system prompt and add a unique 32-128-token
suffix; outputs are 8-64 tokens (EOS ignored, greedy). Reported per mode:
prefill tokens actually computed (from the engine's counters) and throughput.
"""

import random
import time
from dataclasses import asdict, dataclass

from loadgen.bench_model import BENCH_MODEL_CONFIG, BenchRequest


@dataclass(slots=True)
class PrefixResult:
    mode: str
    seconds: float
    prefill_tokens: int
    output_tokens: int
    num_requests: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def make_shared_prefix_workload(num_requests: int, seed: int, vocab: int, system_len: int = 1024,
                                suffix_range=(32, 128), output_range=(8, 64)) -> list[BenchRequest]:
    rng = random.Random(seed)
    system = [rng.randrange(1, vocab - 1) for _ in range(system_len)]
    return [
        BenchRequest(system + [rng.randrange(1, vocab - 1) for _ in range(rng.randint(*suffix_range))], rng.randint(*output_range))
        for _ in range(num_requests)
    ]


def run_prefix_mode(path: str, reqs: list[BenchRequest], caching: bool, **engine_kwargs) -> PrefixResult:
    from engine import LLM, SamplingParams

    llm = LLM(model=path, dtype="float32", device="cpu", enable_prefix_caching=caching, **engine_kwargs)
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    start = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params)
    seconds = time.perf_counter() - start
    stats = llm.engine.stats()
    return PrefixResult("cache on" if caching else "cache off", seconds, stats.total_prefill_tokens,
                        sum(len(o.token_ids) for o in outs), len(reqs))


def run_shared_prefix(model_dir: str, num_requests: int, seed: int, engine_kwargs: dict) -> dict:
    reqs = make_shared_prefix_workload(num_requests, seed, BENCH_MODEL_CONFIG["vocab_size"])
    results = []
    for caching in (True, False):
        r = run_prefix_mode(model_dir, reqs, caching, **engine_kwargs)
        results.append(r)
        print(f"{r.mode:10s} prefill tokens computed {r.prefill_tokens:8d}  {r.seconds:7.1f} s  "
              f"{r.tokens_per_s:8.1f} output tok/s  {r.num_requests / r.seconds:6.2f} req/s", flush=True)
    on, off = results
    report = {
        "workload": "shared-prefix", "num_requests": num_requests, "seed": seed, "engine_kwargs": engine_kwargs,
        "results": [dict(asdict(r), tokens_per_s=r.tokens_per_s) for r in results],
        "prefill_tokens_saved": 1 - on.prefill_tokens / off.prefill_tokens,
        "throughput_ratio": on.tokens_per_s / off.tokens_per_s,
    }
    print(f"prefill computed: {100 * report['prefill_tokens_saved']:.1f}% fewer with the cache; "
          f"throughput {report['throughput_ratio']:.2f}x")
    return report
