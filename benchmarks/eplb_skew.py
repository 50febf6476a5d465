"""Expert load balancing on a skewed router, side by side in one run: experts divided over 4 CPU processes
(gloo, one torch thread each), EPLB off vs on.

    python -m benchmarks.eplb_skew [--ranks 4] [--prompts 24] [--prompt-tokens 192] [--json]

The model is a random DeepSeek-V3-layout checkpoint (sigmoid routing with a per-expert correction bias, no
groups, no shared expert, every layer MoE; the checkpoint's empty shared-expert tensors are ignored) with 16
experts, top-2, 4 spare slots with EPLB (one per rank at 4 ranks). Each layer's correction bias is raised on
experts 0 and 1 by the amount that sends them about 40% of the picks (calibrated on the checkpoint's router
with unit-normal inputs; the share the engine measured is printed). Experts 0-3 sit on rank 0 (of 4), so
without balancing rank 0 gets about half of every layer's work.

Each mode: an engine of 4 ranks, a warm-up round of the workload (with EPLB: the rebalance happens here, from
that round's measured load), then the measured round: the same number of fresh prompts (prefill-heavy: each
asks for 4 tokens), greedy. Printed per mode: tokens per second over the measured round, the imbalance (per
layer max over ranks / mean of tokens routed to each rank's experts, averaged over layers) over the measured
round, the hot experts' share of picks, and for EPLB the rebalance count, bytes moved and the time the
rebalance held the engine (the policy plus the weight move).

On a machine with fewer cores than ranks the ranks share cores: a rank waiting for the hot one leaves its core
to it, so the wall-time gain is smaller than the imbalance change suggests; the printed "MoE bound" is the
speedup of the expert work alone with one core per rank (imbalance off / on), a prediction, not a measurement.
"""

import argparse
import json
import os
import random
import tempfile
import time

import torch

NUM_EXPERTS, TOP_K, HOT, HOT_SHARE = 16, 2, 2, 0.40
ENGINE = dict(device="cpu", cpu_threads=1, block_size=16, max_num_batched_tokens=1024, max_num_seqs=32,
              kv_cache_memory_gb=0.5, enable_expert_parallel=True)


def write_checkpoint(path: str, seed: int, hidden: int, inter: int, layers: int) -> float:
    """A random DeepSeek-V3-layout checkpoint with experts 0 and 1 favoured by the correction bias; returns the
    bias added (the same in every layer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "deepseek_v3", vocab_size=512, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K,
        moe_intermediate_size=inter, n_shared_experts=0, first_k_dense_replace=0, n_group=1, topk_group=1,
        routed_scaling_factor=1.0, norm_topk_prob=True, max_position_embeddings=2048, initializer_range=0.05,
        eos_token_id=511, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    boost = 0.0
    with torch.no_grad():
        for layer in model.model.layers:
            gate = layer.mlp.gate
            gate.e_score_correction_bias.normal_(0.0, 0.01, generator=gen)
            boost = calibrate(gate.weight, gate.e_score_correction_bias, hidden, gen)
            gate.e_score_correction_bias[:HOT] += boost
    model.save_pretrained(path)
    return boost


def hot_share(weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor) -> float:
    scores = torch.sigmoid(x @ weight.T) + bias  # [T, E]
    picks = scores.topk(TOP_K, dim=-1).indices
    return float((picks < HOT).float().mean())


def calibrate(weight: torch.Tensor, bias: torch.Tensor, hidden: int, gen: torch.Generator) -> float:
    """The bias to add to the hot experts so they take ``HOT_SHARE`` of the picks on unit-normal inputs."""
    x = torch.randn(8192, hidden, generator=gen)
    lo, hi = 0.0, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        shifted = bias.clone()
        shifted[:HOT] += mid
        lo, hi = (mid, hi) if hot_share(weight, shifted, x) < HOT_SHARE else (lo, mid)
    return (lo + hi) / 2


def per_layer_imbalance(load: list[list[int]], placement_of, ranks: int) -> float:
    """Mean over layers of max/mean tokens per rank, ``placement_of(layer)`` giving the rank of each expert
    (spread evenly over replicas is what the engine does; for the contiguous split one rank per expert)."""
    ratios = []
    for layer, counts in enumerate(load):
        per_rank = [0.0] * ranks
        for expert, n in enumerate(counts):
            held_by = placement_of(layer, expert)
            for r in held_by:
                per_rank[r] += n / len(held_by)
        ratios.append(max(per_rank) * ranks / sum(per_rank))
    return sum(ratios) / len(ratios)


def run_mode(name: str, model_dir: str, rounds: list[list[list[int]]], ranks: int, extra: dict) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(model_dir, **ENGINE, tensor_parallel_size=ranks, **extra)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    try:
        llm.generate(rounds[0], params)  # warm-up; with EPLB the rebalance happens from this round's load
        before = llm.engine.stats()
        start = time.perf_counter()
        outs = llm.generate(rounds[1], params)
        seconds = time.perf_counter() - start
        after = llm.engine.stats()
    finally:
        llm.engine.close()
    tokens = sum(len(p) for p in rounds[1]) + sum(len(o.token_ids) for o in outs)
    load = [[a - b for a, b in zip(la, lb)] for la, lb in zip(after.expert_load, before.expert_load)]  # [L][E]
    share = sum(sum(layer[:HOT]) for layer in load) / sum(map(sum, load))
    balancer = llm.engine.runner.eplb
    if balancer is None:
        per_rank = NUM_EXPERTS // ranks
        imbalance = per_layer_imbalance(load, lambda layer, e: [e // per_rank], ranks)
    else:
        slots = balancer.slots_per_rank
        where = [[[s // slots for s, held in enumerate(p) if held == e] for e in range(NUM_EXPERTS)]
                 for p in balancer.placements]
        imbalance = per_layer_imbalance(load, lambda layer, e: where[layer][e], ranks)
    return dict(mode=name, seconds=seconds, tokens=tokens, tokens_per_s=tokens / seconds, imbalance=imbalance,
                hot_share=share, rebalances=after.eplb_rebalances, bytes_moved=after.eplb_bytes_moved,
                rebalance_ms=after.eplb_last_rebalance_ms, slots_copied=after.eplb_slots_copied,
                predicted_after=after.eplb_imbalance_after)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=24, help="prompts per round")
    parser.add_argument("--prompt-tokens", type=int, default=192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--expert-intermediate", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=4, help="expert-parallel ranks (processes, 1 thread each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    rounds = [[[rng.randrange(1, 510) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
              for _ in range(2)]
    warmup_steps = -(-args.prompts * args.prompt_tokens // ENGINE["max_num_batched_tokens"]) + 4
    with tempfile.TemporaryDirectory() as model_dir:
        boost = write_checkpoint(model_dir, args.seed, args.hidden, args.expert_intermediate, args.layers)
        eplb = dict(enable_eplb=True, num_redundant_experts=4, eplb_window_steps=warmup_steps,
                    eplb_interval_steps=warmup_steps)
        results = [run_mode("EPLB off", model_dir, rounds, args.ranks, {}),
                   run_mode("EPLB on", model_dir, rounds, args.ranks, eplb)]
    off, on = results
    summary = dict(cpu_cores=os.cpu_count(), bias=boost, results=results, speedup=on["tokens_per_s"] / off["tokens_per_s"],
                   moe_bound=off["imbalance"] / on["imbalance"])
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"16 experts, top-2, experts 0-1 biased (+{boost:.3f}); {args.ranks} CPU ranks x 1 thread on {os.cpu_count()} "
          f"cores; {args.prompts} prompts x {args.prompt_tokens} tokens, 4 generated each, per round")
    print(f"{'mode':<9} {'tok/s':>8} {'s':>6} {'imbalance':>9} {'hot share':>9} {'rebalances':>10} "
          f"{'MB moved':>8} {'rebalance ms':>12}")
    for r in results:
        print(f"{r['mode']:<9} {r['tokens_per_s']:>8.0f} {r['seconds']:>6.2f} {r['imbalance']:>9.3f} "
              f"{r['hot_share']:>9.3f} {r['rebalances']:>10} {r['bytes_moved'] / 1e6:>8.1f} {r['rebalance_ms']:>12.1f}")
    print(f"throughput on / off: {summary['speedup']:.2f}x (goal >= 1.3x); imbalance after: {on['imbalance']:.3f} "
          f"(goal <= 1.15, from {off['imbalance']:.3f}); rebalance {on['rebalance_ms']:.0f} ms (goal < 1000); "
          f"MoE bound with a core per rank: {summary['moe_bound']:.2f}x (predicted)")


if __name__ == "__main__":
    main()
