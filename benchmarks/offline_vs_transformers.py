"""Offline throughput, moegate vs transformers' best mode (static batches of 16), on model shapes side by side.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.offline_vs_transformers --rounds 3
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.offline_vs_transformers --shapes deepseek-v2-lite-small

Each round runs, for each shape (the bench model of ``loadgen.bench_model`` and a small one: hidden
256), moegate then transformers on the same requests; the rounds alternate so machine drift hits
both systems alike. Prints each round's tokens/s and the median ratio per shape.

The moegate engine raises glibc's mmap/trim thresholds when it starts on the CPU
(``engine.worker.cpu_allocator``), a per-process setting that speeds transformers up too
(fewer page faults for its growing KV cache). It is applied here before anything runs, so
both systems always run with the same allocator, whichever goes first.
"""

import argparse
import statistics
import tempfile

import torch

from engine.worker.cpu_allocator import keep_freed_memory
from loadgen import bench_model, offline

# The bench model with hidden 256 (heads 4/2, experts of 128): the small shape.
SMALL_OVERRIDES = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=128,
                       intermediate_size=512)

# A small DeepSeek-V2-Lite shape (MLA without q LoRA, softmax greedy routing, a dense first layer, 2 shared
# experts), with the bench model's vocabulary, depth and hidden 256.
DEEPSEEK_V2_LITE_SMALL = dict(
    model_type="deepseek_v2", vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16,
    v_head_dim=32, n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=128, n_shared_experts=2,
    first_k_dense_replace=1, intermediate_size=512, topk_method="greedy", routed_scaling_factor=1.0,
    max_position_embeddings=2048, initializer_range=0.05, eos_token_id=8191, bos_token_id=None, pad_token_id=0,
    tie_word_embeddings=False,
)

# name -> (config overrides of the qwen3_moe bench model, or a whole config with its model_type; number of
# requests, prompt range, output range)
SHAPES = {
    "small": (SMALL_OVERRIDES, 64, (16, 256), (8, 128)),
    "bench": ({}, 128, (16, 512), (8, 256)),
    "deepseek-v2-lite-small": (DEEPSEEK_V2_LITE_SMALL, 64, (16, 256), (8, 128)),
}


def _write_model(path: str, overrides: dict, seed: int) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    if "model_type" in overrides:
        fields = dict(overrides)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    else:
        config = AutoConfig.for_model("qwen3_moe", **{**bench_model.BENCH_MODEL_CONFIG, **overrides})
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="small,bench", help=f"comma-separated subset of {','.join(SHAPES)}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bench-requests", type=int, default=None, help="override the bench shape's 128 requests")
    args = p.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    keep_freed_memory()
    print(f"torch threads: {torch.get_num_threads()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="moegate-bench-") as root:
        setups = {}
        for name in shapes:
            overrides, num_requests, prompts, outputs = SHAPES[name]
            if name == "bench" and args.bench_requests:
                num_requests = args.bench_requests
            path = f"{root}/{name}"
            _write_model(path, overrides, args.seed)
            reqs = bench_model.make_workload(num_requests, args.seed, bench_model.BENCH_MODEL_CONFIG["vocab_size"], prompts, outputs)
            setups[name] = (path, reqs)
        ratios: dict[str, list[float]] = {name: [] for name in shapes}
        for rnd in range(args.rounds):
            for name in shapes:
                path, reqs = setups[name]
                ours = offline.run_moegate(path, reqs, max_num_seqs=128, max_num_batched_tokens=2048)
                theirs = offline.run_hf_static(path, reqs)
                ratios[name].append(ours.tokens_per_s / theirs.tokens_per_s)
                print(f"round {rnd} {name:5s} ({len(reqs)} requests): moegate {ours.tokens_per_s:7.1f} tok/s "
                      f"({ours.seconds:5.1f} s), transformers static-16 {theirs.tokens_per_s:7.1f} tok/s "
                      f"({theirs.seconds:5.1f} s): {ratios[name][-1]:.2f}x", flush=True)
        for name in shapes:
            r = ratios[name]
            print(f"{name}: median {statistics.median(r):.2f}x (min {min(r):.2f}x, max {max(r):.2f}x, {len(r)} rounds)")


if __name__ == "__main__":
    main()
