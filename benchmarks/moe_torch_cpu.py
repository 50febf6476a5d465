"""The torch MoE path on the CPU: per-expert loop vs grouped matmuls, side by side in one run.

    python -m benchmarks.moe_torch_cpu kernels [--threads 1]   # one MoE layer, decode- and prefill-sized T
    python -m benchmarks.moe_torch_cpu e2e [--threads 2]       # the engine end to end, loop and grouped alternating

Legend: T tokens, H hidden, I expert intermediate, E experts, k top-k, S = T*k slots.

``kernels`` times ``fused_moe_loop`` (the path before grouped matmuls),
``fused_moe_grouped`` (the default now) and the grouped path with the other
combine this was chosen against (one ``index_add_`` over all S rows instead of
un-permuting and summing over k: no faster here, and atomic on CUDA), float32 with random routing. The calls are
interleaved (one of each per round) so that a shared machine's drift hits
every variant alike; the median of the rounds is reported.

``e2e`` runs the offline engine (``engine.LLM``) on a random-weight Qwen3-MoE
model (hidden 256, 4 layers, 16 experts, top-4, expert size 256; float32) and
a fixed workload (64 requests, prompts 16-256 tokens, outputs 8-128, greedy,
EOS ignored), alternating runs with every MoE layer on the loop ("torch-loop")
and on the torch backend ("torch": grouped up to its CPU size limit, printed
as "grouped"; a fresh engine each run, same weights), and checks that both
produce the same tokens. Throughput counts output tokens per second of wall time.
"""

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from moe_kernels.activation import gated_activation_
from moe_kernels.expert_sort import sort_slots_by_expert
from moe_kernels.grouped_backend import fused_moe_grouped
from moe_kernels.routing import route
from moe_kernels.torch_backend import fused_moe_loop

# (name, H, I, E, k): the small model of ``e2e`` and the offline bench model (loadgen.bench_model.BENCH_MODEL_CONFIG).
KERNEL_SHAPES = (("small-h256", 256, 256, 16, 4), ("bench-h512", 512, 256, 16, 4))
KERNEL_TOKENS = (1, 4, 16, 64, 256, 1024, 2048)

SMALL_MODEL = ("qwen3-30b-a3b:hidden_size=256,num_hidden_layers=4,num_attention_heads=4,num_key_value_heads=2,"
               "head_dim=64,num_experts=16,num_experts_per_tok=4,moe_intermediate_size=256,vocab_size=8192,"
               "max_position_embeddings=2048,bos_token_id=1,eos_token_id=8191")


def grouped_index_add_combine(x, w13, w2, topk_weights, topk_ids, activation="silu"):
    """The grouped path with the combine it was measured against: weights in, one index_add_ over all S rows."""
    num_tokens = topk_ids.shape[0]
    slots = sort_slots_by_expert(topk_ids, w13.shape[0])
    offs = torch.cumsum(slots.counts, 0, dtype=torch.int32)  # [E]
    gate_up = torch._grouped_mm(x.index_select(0, slots.tokens), w13.transpose(-2, -1), offs=offs)  # [S, 2I]
    ys = torch._grouped_mm(gated_activation_(gate_up, activation), w2.transpose(-2, -1), offs=offs).float()  # [S, H]
    ys.mul_(topk_weights.reshape(-1).index_select(0, slots.order).float()[:, None])
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32)  # [T, H]
    return out.index_add_(0, slots.tokens, ys).to(x.dtype)


KERNEL_VARIANTS: dict[str, Callable] = {
    "loop": fused_moe_loop, "grouped": fused_moe_grouped, "grouped+index_add": grouped_index_add_combine,
}


def interleaved_medians(calls: dict[str, Callable[[], object]], rounds: int, warmup: int = 2) -> dict[str, float]:
    """Median wall ms of each call, timed one of each per round."""
    for _ in range(warmup):
        for call in calls.values():
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_kernels(tokens: tuple[int, ...], rounds: int) -> None:
    names = list(KERNEL_VARIANTS)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), float32, median of {rounds} interleaved rounds")
    print(f"{'shape':<11} {'T':>5} " + " ".join(f"{n + ' ms':>19}" for n in names) + f" {'loop/grouped':>13}")
    for name, hidden, inter, num_experts, top_k in KERNEL_SHAPES:
        gen = torch.Generator().manual_seed(0)
        w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5  # [E, 2I, H]
        w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5  # [E, H, I]
        for num_tokens in tokens:
            x = torch.randn(num_tokens, hidden, generator=gen)  # [T, H]
            weights, ids = route(torch.randn(num_tokens, num_experts, generator=gen), top_k, renormalize=True)
            ref = fused_moe_loop(x, w13, w2, weights, ids)
            for fn in KERNEL_VARIANTS.values():  # every variant computes the same layer
                assert torch.allclose(fn(x, w13, w2, weights, ids), ref, rtol=1e-4, atol=1e-5)
            calls = {n: (lambda fn=fn: fn(x, w13, w2, weights, ids)) for n, fn in KERNEL_VARIANTS.items()}
            ms = interleaved_medians(calls, rounds if num_tokens <= 256 else max(5, rounds // 4))
            print(f"{name:<11} {num_tokens:>5} " + " ".join(f"{ms[n]:>19.3f}" for n in names)
                  + f" {ms['loop'] / ms['grouped']:>12.2f}x", flush=True)


def _moe_blocks(llm) -> list:
    from engine.layers.moe import SparseMoeBlock

    model = getattr(llm.engine, "model", None) or llm.engine.runner.model
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def run_e2e_once(backend: str, threads: int, reqs) -> tuple[float, int, list[list[int]]]:
    """One engine run with every MoE layer on ``backend`` ("torch" or "torch-loop"): (seconds, tokens, outputs)."""
    from engine import LLM, SamplingParams

    llm = LLM(model="small-qwen3-moe", random_weights=SMALL_MODEL, dtype="float32", device="cpu",
              max_num_seqs=64, max_num_batched_tokens=2048, cpu_threads=threads)
    blocks = _moe_blocks(llm)
    assert blocks, "no MoE layer found to switch"
    for block in blocks:
        block.backend = backend
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    start = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.token_ids) for o in outs), [list(o.token_ids) for o in outs]


def bench_e2e(threads: int, pairs: int, num_requests: int, seed: int) -> None:
    from loadgen.bench_model import make_workload

    reqs = make_workload(num_requests, seed, 8192, prompt_range=(16, 256), output_range=(8, 128))
    print(f"torch {torch.__version__}, {threads} thread(s); {num_requests} requests, prompts 16-256, outputs 8-128")
    print(f"{'run':>3} {'MoE path':<8} {'output tokens':>13} {'seconds':>8} {'tok/s':>8}")
    results: dict[str, list[float]] = {"torch-loop": [], "torch": []}
    outputs: dict[str, list[list[int]]] = {}
    for i in range(pairs):
        order = ("torch-loop", "torch") if i % 2 == 0 else ("torch", "torch-loop")  # alternate who goes first
        for backend in order:
            seconds, tokens, outs = run_e2e_once(backend, threads, reqs)
            results[backend].append(tokens / seconds)
            outputs.setdefault(backend, outs)
            label = "loop" if backend == "torch-loop" else "grouped"
            print(f"{len(sum(results.values(), [])):>3} {label:<8} {tokens:>13} {seconds:>8.1f} {tokens / seconds:>8.1f}", flush=True)
    same = outputs["torch"] == outputs["torch-loop"]
    loop, grouped = statistics.median(results["torch-loop"]), statistics.median(results["torch"])
    # Each pair ran back to back, so its ratio is the least disturbed by the machine's drift.
    pair_ratios = [g / lo for g, lo in zip(results["torch"], results["torch-loop"])]
    print(f"median tok/s: loop {loop:.1f}, grouped {grouped:.1f}; grouped/loop per pair: "
          f"{', '.join(f'{r:.2f}x' for r in pair_ratios)} (median {statistics.median(pair_ratios):.2f}x); "
          f"same tokens on both paths: {same}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moe_torch_cpu", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kernels", help="one MoE layer: loop vs grouped vs grouped with index_add_ combine")
    k.add_argument("--threads", type=int, default=1)
    k.add_argument("--tokens", default=",".join(map(str, KERNEL_TOKENS)), help="comma-separated token counts")
    k.add_argument("--rounds", type=int, default=40, help="interleaved rounds (a quarter of them above T=256)")
    e = sub.add_parser("e2e", help="the engine end to end, loop and grouped runs alternating")
    e.add_argument("--threads", type=int, default=2)
    e.add_argument("--pairs", type=int, default=2, help="runs of each path")
    e.add_argument("--num-requests", type=int, default=64)
    e.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        if args.what == "kernels":
            bench_kernels(tuple(int(t) for t in args.tokens.split(",")), args.rounds)
        else:
            bench_e2e(args.threads, args.pairs, args.num_requests, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
