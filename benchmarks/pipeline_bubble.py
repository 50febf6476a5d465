"""Pipeline parallelism on the CPU: throughput of 2 stages (1 torch thread each) against one 1-thread process, on
a long-prompt workload, side by side in one run, with the share of its time each stage waited.

    python -m benchmarks.pipeline_bubble                        # 8 prompts of 1024 tokens; 1 and 4 micro-batches
    python -m benchmarks.pipeline_bubble --micro-batches 1 2 4 8 --prompts 4 --prompt-len 512

Each configuration runs the same requests (random prompts, 4 output tokens, greedy) on a random-weight MoE
model, after one warm-up request, in interleaved rounds (the best of each is shown: the machine's load
drifts); throughput is prompt plus output tokens per second of wall time. A
stage's wait share is its time blocked receiving from the stage before it (stage 0: the final rows back from
the last stage) over its time in steps. The goal is 2 stages >= 1.6x one process; on a machine with fewer free
cores than processes the stages share cores and the ratio says little.
"""

import argparse
import os
import random
import time

from engine.core.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine

MODEL = ("qwen3-30b-a3b:hidden_size=512,num_hidden_layers=8,num_attention_heads=8,num_key_value_heads=2,"
         "head_dim=64,num_experts=16,num_experts_per_tok=4,moe_intermediate_size=512,vocab_size=8192,"
         "max_position_embeddings=4096,bos_token_id=1,eos_token_id=8191")


def run(prompts: list[list[int]], output: int, chunk: int, **parallel) -> tuple[float, list]:
    """(tokens per second, each rank's StageTiming) of the workload on an engine built with ``parallel``."""
    config = EngineConfig(model="bench", random_weights=MODEL, device="cpu", dtype="float32", cpu_threads=1,
                          block_size=16, num_kv_blocks=sum(len(p) + output for p in prompts) // 16 + 64,
                          max_num_seqs=len(prompts), max_num_batched_tokens=chunk, **parallel)
    engine = LLMEngine(config)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
        engine.add_request(prompts[0][:64], params, request_id="warm-up")
        while engine.has_unfinished():
            engine.step()
        before = {t.stage: (t.busy_s, t.wait_s) for t in engine.stage_timings()}
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, params, request_id=str(i))
        while engine.has_unfinished():
            engine.step()
        elapsed = time.perf_counter() - start
        timings = engine.stage_timings()
        for t in timings:  # the measured requests only
            busy, wait = before.get(t.stage, (0.0, 0.0))
            t.busy_s, t.wait_s = t.busy_s - busy, t.wait_s - wait
        return sum(len(p) + output for p in prompts) / elapsed, timings
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens (chunked prefill)")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 8000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    print(f"{os.cpu_count()} CPUs; {args.prompts} prompts of {args.prompt_len} tokens, {args.output} output tokens, "
          f"chunks of {args.chunk}; 1 torch thread per process; best of {args.rounds} interleaved rounds")
    configs = {"one process": {}, **{f"2 stages, {m} micro-batches": dict(pipeline_parallel_size=2,
                                                                      pipeline_micro_batches=m)
                                     for m in args.micro_batches}}
    best: dict[str, tuple[float, list]] = {}
    for _ in range(args.rounds):  # interleaved, so that drift in the machine's load hits every configuration
        for name, parallel in configs.items():
            rate, timings = run(prompts, args.output, args.chunk, **parallel)
            if rate > best.get(name, (0.0, []))[0]:
                best[name] = (rate, timings)
    single = best["one process"][0]
    for name, (rate, timings) in best.items():
        waits = ", ".join(f"stage {t.stage} waits {100 * t.wait_share:.0f}%" for t in timings)
        print(f"{name:<28} {rate:9.1f} tok/s   {rate / single:.2f}x   {f'({waits})' if waits else ''}")

if __name__ == "__main__":
    main()
