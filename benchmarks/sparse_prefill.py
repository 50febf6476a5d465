"""Sparse vs dense MLA prefill as the context grows: one prompt chunk at the end of a 2k and of a 16k context,
DeepSeek Sparse Attention (DeepSeek-V3.2) beside dense MLA (DeepSeek-V3) of the same shape, side by side in one run.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.sparse_prefill           # CPU, float32, 64 heads
    .venv/bin/python -m benchmarks.sparse_prefill --device cuda --heads 128 --kernel triton   # GPU, bfloat16

The shape is attention-dominated as ``benchmarks.sparse_decode``'s (its models, caches and random rows): latent
512 + rope 64, q LoRA, V3.2's indexer keys and top-k as published (128 wide, top 2,048 tokens), a narrow hidden
size, tiny experts. ``--heads`` attention heads: 64 by default, half of V3's at one rank, as a chunk of dense MLA
at 16k takes seconds on the CPU (with 16 the torch path's copying of the gathered rows, not its arithmetic, sets
its time there); the indexer's heads follow them in V3.2's proportion (64 to its 128), so that the indexer's work per
key stays in proportion to attention's (the full 64 beside 16 heads would make the indexer alone cost more than
dense MLA). The chunk
is ``--chunk`` prompt tokens whose earlier context is already cached. Each round times the chunk's whole forward
(``model.forward``: every layer, the chunk's cache writes and the indexer's scoring included) for each model at each
context, alternating; the medians and each model's 16k/2k ratio are printed, and sparse over dense at each context.
Dense MLA expands and attends to every cached row, so its chunk grows with the context; a sparse chunk's queries
attend to their selected rows only (a context no longer than top-k is all selected: it runs as dense MLA does),
and only its indexer's scoring grows with the context.
"""

import argparse
import statistics

import torch

from benchmarks.sparse_decode import MODELS, add_run_args, build, run_device, time_rounds
from engine.core.scheduler import ScheduledRequest
from engine.worker.batch_builder import build_batch

BLOCK = 16


def chunk_batch(chunk: int, context: int, blocks_per_req: int, device: torch.device):
    """The last ``chunk`` prompt tokens of a ``context``-token prompt, its first ``context - chunk`` cached."""
    used = -(-context // BLOCK)
    part = ScheduledRequest(None, chunk, list(range(used)), True, context - chunk, [7] * chunk)
    assert used <= blocks_per_req
    return build_batch([part], "torch", BLOCK, None, 1, device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="2048,16384", help="two context lengths: short,long (the chunk included)")
    p.add_argument("--chunk", type=int, default=256, help="prompt tokens in the timed chunk")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--heads", type=int, default=64, help="attention heads (V3 has 128 at one rank)")
    p.add_argument("--topk", type=int, default=2048, help="the indexer's top-k (2,048 as published)")
    p.add_argument("--index-heads", type=int, default=None, help="the indexer's heads (default: half of --heads, "
                   "V3.2's 64 to 128)")
    p.add_argument("--kernel", default="torch", choices=["torch", "triton", "masked"],
                   help="the sparse layers' prefill path: torch (gathers the rows), the Triton kernel (CUDA), or "
                        "masked (dense MLA's prefill with the selection as a mask: the CUDA default)")
    add_run_args(p, rounds=3)
    args = p.parse_args()
    device, dtype = run_device(args)
    contexts = [int(c) for c in args.contexts.split(",")]
    if len(contexts) != 2 or min(contexts) <= args.chunk:
        p.error("--contexts takes two lengths, each longer than --chunk")
    index_heads = args.index_heads or max(1, args.heads // 2)
    models = {name: build(preset, args.layers, args.heads, args.topk, max(contexts), 1, dtype, device, index_heads)
              for name, preset in MODELS.items()}
    for layer in models["sparse"][0].attention_layers():
        layer.prefill_kernel = args.kernel
    batches = {(name, c): chunk_batch(args.chunk, c, n, device) for name, (_, n) in models.items() for c in contexts}
    print(f"{args.layers} layers, {args.heads} heads, latent 512 + rope 64, indexer {index_heads} heads of 128, "
          f"top-{args.topk}, {args.kernel} prefill, chunk "
          f"{args.chunk}, {dtype}, {device}, torch threads {torch.get_num_threads()}", flush=True)
    times = time_rounds(models, batches, args.rounds, device)
    short, long = contexts
    med = {key: statistics.median(t) * 1e3 for key, t in times.items()}
    for name in models:
        cells = "  ".join(f"{c:>6} ctx {med[name, c]:9.1f} ms" for c in contexts)
        print(f"{name:6s} ({MODELS[name]:13s}) {cells}   {long}/{short}: {med[name, long] / med[name, short]:.2f}x",
              flush=True)
    print("sparse/dense: " + "  ".join(f"{c} ctx {med['sparse', c] / med['dense', c]:.2f}x" for c in contexts))


if __name__ == "__main__":
    main()
