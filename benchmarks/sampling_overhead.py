"""What penalties, logit_bias, min_p and logprobs cost a step, and what requests that ask for none of them pay.

    python -m benchmarks.sampling_overhead [--rows 64] [--vocab 151936] [--threads 2] [--rounds 30]

``sampler``: the engine's Sampler alone on [rows, vocab] float32 random logits (Qwen3's vocabulary by
default), every request with a 512-token prompt and 256 generated tokens, temperature 1. Variants, timed
interleaved (one of each per round, median reported): nobody asks; one request with repetition, frequency
and presence penalties; one with a 300-entry logit_bias; one with min_p; one with 20 logprobs; every request
penalised. ``step``: the offline engine's decode steps on the demo checkpoint (vocabulary 1,536) with 32
running requests, all plain vs one of them penalised, alternating engines; mean decode-step time.
"""

import argparse
import random
import statistics
import time

import torch

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.sampling.sampler import Sampler

PENALISED = dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5)


def _requests(rng: random.Random, rows: int, vocab: int, special: dict | None, everyone: bool = False) -> list[Request]:
    reqs = []
    for i in range(rows):
        extra = special if special is not None and (everyone or i == 0) else {}
        req = Request(str(i), [rng.randrange(vocab) for _ in range(512)],
                      SamplingParams(temperature=1.0, max_tokens=1024, **extra), 1024)
        for _ in range(256):
            req.append_output_token(rng.randrange(vocab))
        reqs.append(req)
    return reqs


def bench_sampler(rows: int, vocab: int, rounds: int) -> dict[str, float]:
    rng = random.Random(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bias = {rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(300)}
    variants = {
        "nobody asks": _requests(rng, rows, vocab, None),
        "1 penalised": _requests(rng, rows, vocab, PENALISED),
        "1 logit_bias (300)": _requests(rng, rows, vocab, {"logit_bias": bias}),
        "1 min_p": _requests(rng, rows, vocab, {"min_p": 0.05}),
        "1 logprobs=20": _requests(rng, rows, vocab, {"logprobs": 20}),
        f"all {rows} penalised": _requests(rng, rows, vocab, PENALISED, everyone=True),
    }
    sampler = Sampler(device, seed=0)
    logits = torch.randn(rows, vocab, device=device)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds + 2):
        for name, reqs in variants.items():
            x = logits.clone()
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            sampler(x, reqs)  # reads the tokens: waits for the device
            if r >= 2:  # two warm-up rounds
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def bench_step(rounds: int) -> dict[str, float]:
    import tempfile

    from engine import LLM
    from engine.loading.demo_model import write_demo_model

    path = tempfile.mkdtemp()
    write_demo_model(path, seed=0)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1300) for _ in range(rng.randint(16, 64))] for _ in range(32)]
    results: dict[str, list[float]] = {"all plain": [], "1 penalised": []}
    for r in range(rounds):
        for name in results:
            llm = LLM(model=path, max_num_seqs=32, max_num_batched_tokens=4096)
            engine = llm.engine
            for i, p in enumerate(prompts):
                extra = PENALISED if name == "1 penalised" and i == 0 else {}
                engine.add_request(p, SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True, **extra))
            engine.step()  # the prefill
            times = []
            while engine.has_unfinished():
                start = time.perf_counter()
                engine.step()
                times.append((time.perf_counter() - start) * 1e3)
            results[name].append(statistics.mean(times))
    return {name: statistics.median(t) for name, t in results.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--step-rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sampler = bench_sampler(args.rows, args.vocab, args.rounds)
    base = sampler["nobody asks"]
    print(f"sampler, {args.rows} rows x {args.vocab} vocabulary, median of {args.rounds} rounds:")
    for name, ms in sampler.items():
        print(f"  {name:<22} {ms:8.2f} ms  {ms / base:5.2f}x")
    step = bench_step(args.step_rounds)
    base = step["all plain"]
    print(f"decode step, demo model, 32 running requests, median of {args.step_rounds} runs' mean step:")
    for name, ms in step.items():
        print(f"  {name:<22} {ms:8.2f} ms  {ms / base:5.2f}x")


if __name__ == "__main__":
    main()
