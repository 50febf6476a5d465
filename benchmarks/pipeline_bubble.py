"""Pipeline parallelism on the CPU: throughput of 2 stages (1 torch thread each) against one 1-thread process, on
a long-prompt workload, side by side in one run, with the share of its time each stage waited.

    python -m benchmarks.pipeline_bubble                        # 8 prompts of 1024 tokens; 1, 2 and 4 micro-batches
    python -m benchmarks.pipeline_bubble --micro-batches 1 2 4 8 --prompts 4 --prompt-len 512
    python -m benchmarks.pipeline_bubble --overlap on off          # steps overlapped across the stages or not

Each configuration runs the same requests (random prompts, 4 output tokens, greedy) on a random-weight MoE
model, after one warm-up request, in interleaved rounds, every other round in reverse order (median and range of each); throughput is prompt plus output tokens per second of wall time. A
stage's wait share is its time blocked receiving from the stage before it (stage 0: the final rows back from
the last stage) or on its sends' completion, over the wall time; its busy CPU time (thread time) shows how much of its busy wall time it
really ran, which matters on a machine whose cores are shared. The goal is 2 stages >= 1.6x one process; on a machine with fewer free
cores than processes the stages share cores and the ratio says little.
"""

import argparse
import os
import random
import statistics
import time

from engine.core.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine

MODEL = ("qwen3-30b-a3b:hidden_size=512,num_hidden_layers=8,num_attention_heads=8,num_key_value_heads=2,"
         "head_dim=64,num_experts=16,num_experts_per_tok=4,moe_intermediate_size=512,vocab_size=8192,"
         "max_position_embeddings=4096,bos_token_id=1,eos_token_id=8191")


def run(prompts: list[list[int]], output: int, chunk: int, **parallel) -> tuple[float, list, float, float]:
    """(tokens per second, each rank's StageTiming, wall seconds, rank 0's main-thread CPU seconds) of the
    workload on an engine built with ``parallel``."""
    config = EngineConfig(model="bench", random_weights=MODEL, device="cpu", dtype="float32", cpu_threads=1,
                          block_size=16, num_kv_blocks=sum(len(p) + output for p in prompts) // 16 + 64,
                          max_num_seqs=len(prompts), max_num_batched_tokens=chunk, **parallel)
    engine = LLMEngine(config)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
        engine.add_request(prompts[0][:64], params, request_id="warm-up")
        while engine.has_unfinished():
            engine.step()
        first = engine.stage_timings()
        before = {t.stage: (t.busy_s, t.wait_s) for t in first}
        before_cpu = {t.stage: t.busy_cpu_s for t in first}
        before_steps = {t.stage: t.steps for t in first}
        before_overlapped = {t.stage: t.overlapped_steps for t in first}
        start, cpu = time.perf_counter(), time.thread_time()
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, params, request_id=str(i))
        while engine.has_unfinished():
            engine.step()
        elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu
        timings = engine.stage_timings()
        for t in timings:  # the measured requests only
            busy, wait = before.get(t.stage, (0.0, 0.0))
            busy_cpu = before_cpu.get(t.stage, 0.0)
            t.busy_s, t.wait_s, t.busy_cpu_s = t.busy_s - busy, t.wait_s - wait, t.busy_cpu_s - busy_cpu
            t.steps -= before_steps.get(t.stage, 0)
            t.overlapped_steps -= before_overlapped.get(t.stage, 0)
        return sum(len(p) + output for p in prompts) / elapsed, timings, elapsed, cpu
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens (chunked prefill)")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--overlap", nargs="+", choices=("on", "off"), default=["on"],
                        help="pipelined steps overlapped across the stages (overlap_scheduling) or synchronous")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 8000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    print(f"{os.cpu_count()} CPUs; {args.prompts} prompts of {args.prompt_len} tokens, {args.output} output tokens, "
          f"chunks of {args.chunk}; 1 torch thread per process; {args.rounds} interleaved rounds")
    configs = {"one process": {}, **{
        f"2 stages, {m} mb, overlap {o}": dict(pipeline_parallel_size=2, pipeline_micro_batches=m,
                                               overlap_scheduling=o == "on")
        for m in args.micro_batches for o in args.overlap}}
    results: dict[str, list[tuple[float, list, float, float]]] = {name: [] for name in configs}
    for round_ in range(args.rounds):  # interleaved and alternating, so that drift in the load hits every one
        for name in (list(configs) if round_ % 2 == 0 else list(configs)[::-1]):
            results[name].append(run(prompts, args.output, args.chunk, **configs[name]))
    single = statistics.median(r[0] for r in results["one process"])
    single_cpu = statistics.median(r[3] for r in results["one process"])
    print("throughput: median (range) of the rounds; ratio: median of each round's rate over the median single "
          "process.\nA stage's shares are of its median round's wall time: busy (cpu: its thread's CPU time, "
          "the rest it was runnable but off a core), wait (blocked on a receive or a send's completion), other (rank 0: scheduling, plan "
          "broadcast, LM head, sampling, outputs; other ranks: waiting for the next plan)")
    for name, runs in results.items():
        rates = sorted(r[0] for r in runs)
        median = statistics.median(rates)
        print(f"{name:<28} {median:8.1f} tok/s ({rates[0]:.0f}-{rates[-1]:.0f})   {median / single:.2f}x "
              f"({rates[0] / single:.2f}-{rates[-1] / single:.2f})")
        rate, timings, elapsed, cpu = min(runs, key=lambda r: abs(r[0] - median))
        if not timings:
            print(f"{'':<28} CPU {cpu:.2f}s of {elapsed:.2f}s wall")
        for t in timings:
            other = max(elapsed - t.busy_s - t.wait_s, 0.0)
            print(f"{'':<28} stage {t.stage}: busy {100 * t.busy_s / elapsed:3.0f}% (cpu {t.busy_cpu_s:.2f}s), "
                  f"wait {100 * t.wait_s / elapsed:3.0f}%, other {100 * other / elapsed:3.0f}% of {elapsed:.2f}s"
                  + (f", {t.overlapped_steps} of {t.steps} steps overlapped" if t.stage == 0 else ""))
        if timings:
            print(f"{'':<28} stages' compute CPU {sum(t.busy_cpu_s for t in timings):.2f}s against one process's "
                  f"{single_cpu:.2f}s")


if __name__ == "__main__":
    main()
