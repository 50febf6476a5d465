"""Sparse vs dense MLA decode as the context grows: one decode step at 2k and at 16k context, DeepSeek Sparse
Attention (DeepSeek-V3.2) beside dense MLA (DeepSeek-V3) of the same shape, side by side in one run.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.sparse_decode            # CPU, float32
    .venv/bin/python -m benchmarks.sparse_decode --device cuda                # GPU, bfloat16

The shape is attention-dominated: V3's attention at one rank (128 heads, latent 512 + rope 64, q LoRA) and
V3.2's indexer as published (64 heads of 128, top 2,048 tokens), with a narrow hidden size, tiny experts and
``--layers`` layers, random weights. The paged cache is filled with random latent rows and indexer keys (no
prefill: the step's cost does not depend on what the rows hold), ``--batch`` requests each with its own blocks.
Each round times one whole decode step (``model.forward``: every layer, the new token's cache writes included)
for each model at each context, alternating; the medians and each model's 16k/2k ratio are printed. Dense MLA
reads every cached row, so its step grows with the context; the sparse step reads the selected rows only and
grows only by its indexer, which scores every cached key with few heads of small width.

Both run the engine's torch attention path (where the sparse layers run under either backend).
"""

import argparse
import statistics
import time

import torch

from engine.core.config import CacheConfig
from engine.core.scheduler import ScheduledRequest
from engine.loading.random_weights import build_random_model, random_model_config
from engine.worker.batch_builder import build_batch
from engine.worker.cache_binding import attach_kv_caches

BLOCK = 16
# V3's attention at one rank; everything else small so that attention dominates the step.
SHAPE = dict(hidden_size=1024, q_lora_rank=512, intermediate_size=256, moe_intermediate_size=64, n_routed_experts=8,
             num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=0, vocab_size=512)
MODELS = {"sparse": "deepseek-v3.2", "dense": "deepseek-v3"}


def build(preset: str, layers: int, heads: int, topk: int, max_context: int, batch: int, dtype: torch.dtype,
          device: torch.device, index_heads: int | None = None):
    """A random model of ``preset`` at SHAPE with caches for ``batch`` requests of ``max_context`` tokens, filled
    with random rows; request i holds blocks [i * n, (i + 1) * n). ``index_heads``: the indexer's (64 if None)."""
    overrides = dict(SHAPE, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads)
    if preset == MODELS["sparse"]:
        overrides["index_topk"] = topk
        if index_heads is not None:
            overrides["index_n_heads"] = index_heads
    spec = preset + ":" + ",".join(f"{k}={v}" for k, v in overrides.items())
    model = build_random_model(random_model_config(spec), dtype, device, "torch", max_positions=max_context + 1)
    blocks_per_req = -(-(max_context + 1) // BLOCK)
    caches = attach_kv_caches(model.eval(), CacheConfig(BLOCK, batch * blocks_per_req, False), device, dtype)
    gen = torch.Generator(device).manual_seed(0)
    for tensors in caches:
        for t in tensors:
            t.copy_(torch.randn(t.shape, generator=gen, device=device, dtype=torch.float32))
    return model, blocks_per_req


def decode_batch(batch: int, context: int, blocks_per_req: int, device: torch.device):
    """One decode token per request at position ``context`` (its first ``context`` tokens cached)."""
    used = -(-(context + 1) // BLOCK)
    parts = [ScheduledRequest(None, 1, list(range(i * blocks_per_req, i * blocks_per_req + used)), True, context, [7])
             for i in range(batch)]
    return build_batch(parts, "torch", BLOCK, None, 1, device)


def add_run_args(p: argparse.ArgumentParser, rounds: int) -> None:
    """--rounds, --device and --dtype, as the sparse benchmarks take them."""
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="default: float32 on the CPU, bfloat16 on a GPU")


def run_device(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    """The device and dtype ``add_run_args``'s flags name."""
    device = torch.device(args.device)
    return device, getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))


def time_rounds(models: dict, batches: dict, rounds: int, device: torch.device) -> dict[tuple[str, int], list[float]]:
    """Seconds of each forward of ``batches`` ((model name, context) -> batch) on ``models`` (name -> (model, _)),
    every batch once a round, alternating; round 0 warms up and is not kept."""
    times: dict[tuple[str, int], list[float]] = {key: [] for key in batches}
    with torch.inference_mode():
        for rnd in range(rounds + 1):
            for key, fb in batches.items():
                model = models[key[0]][0]
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                model(fb.input_ids, fb.positions, fb.meta)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if rnd:
                    times[key].append(time.perf_counter() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="2048,16384", help="two context lengths: short,long")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=128, help="attention heads (V3's 128 at one rank)")
    p.add_argument("--topk", type=int, default=2048, help="the indexer's top-k (2,048 as published)")
    add_run_args(p, rounds=7)
    args = p.parse_args()
    device, dtype = run_device(args)
    contexts = [int(c) for c in args.contexts.split(",")]
    models = {name: build(preset, args.layers, args.heads, args.topk, max(contexts), args.batch, dtype, device)
              for name, preset in MODELS.items()}
    batches = {(name, c): decode_batch(args.batch, c, n, device) for name, (_, n) in models.items() for c in contexts}
    print(f"{args.layers} layers, {args.heads} heads, latent 512 + rope 64, indexer top-{args.topk}, batch "
          f"{args.batch}, {dtype}, {device}, torch threads {torch.get_num_threads()}", flush=True)
    times = time_rounds(models, batches, args.rounds, device)
    short, long = contexts[0], contexts[-1]
    for name in models:
        med = {c: statistics.median(times[name, c]) * 1e3 for c in contexts}
        cells = "  ".join(f"{c:>6} ctx {med[c]:8.1f} ms" for c in contexts)
        print(f"{name:6s} ({MODELS[name]:13s}) {cells}   {long}/{short}: {med[long] / med[short]:.2f}x", flush=True)


if __name__ == "__main__":
    main()
