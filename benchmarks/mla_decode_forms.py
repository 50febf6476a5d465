"""MLA decode on the CPU: absorbed (attend in latent space) vs expanded (per-head K/V rebuilt from the latents),
side by side in one run, on one layer of DeepSeek-V2-Lite's attention shape (16 heads, latent 512 + rope 64).

    OMP_NUM_THREADS=2 .venv/bin/python -m benchmarks.mla_decode_forms --batch 32 --context 512

Each round times one decode step of ``--batch`` requests (``attend`` over the paged latent cache, projections
excluded: they are the same for both forms), alternating the forms; prints the median per form and the ratio.
"""

import argparse
import statistics
import time

import torch

from engine.core.scheduler import ScheduledRequest
from engine.layers.rotary import RotaryEmbedding
from engine.loading.random_weights import random_model_config
from engine.models.deepseek import mla_from_config
from engine.worker.batch_builder import build_batch

BLOCK = 16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=512, help="tokens already cached per request")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    config = random_model_config("deepseek-v2-lite")
    layer = mla_from_config(config, RotaryEmbedding(config, config.head_dim, args.context + 1))
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, 0.02)
    layer = layer.to(dtype).eval()
    blocks_per_req = -(-(args.context + 1) // BLOCK)
    width = layer.cache_spec().per_token[0][0]
    layer.kv_cache = (torch.randn(args.batch * blocks_per_req + 1, BLOCK, width, dtype=dtype),)
    parts = [ScheduledRequest(None, 1, list(range(i * blocks_per_req, (i + 1) * blocks_per_req)), True, args.context, [0])
             for i in range(args.batch)]
    batch = build_batch(parts, "torch", BLOCK, None, 1, torch.device("cpu"))
    q, latent, k_pe = layer.project(torch.randn(args.batch, config.hidden_size, dtype=dtype), batch.positions)
    times = {"absorbed": [], "expanded": []}
    print(f"torch threads {torch.get_num_threads()}, batch {args.batch}, context {args.context}, {args.dtype}, "
          f"{layer.num_heads} heads, latent {layer.kv_lora_rank} + rope {layer.rope_dim}", flush=True)
    with torch.inference_mode():
        for rnd in range(args.rounds + 1):  # round 0 warms up
            for form in times:
                layer.decode_form = form
                start = time.perf_counter()
                layer.attend(q, latent, k_pe, batch.meta)
                if rnd:
                    times[form].append(time.perf_counter() - start)
    med = {form: statistics.median(t) * 1e3 for form, t in times.items()}
    for form, ms in med.items():
        print(f"{form:9s} decode attention: median {ms:7.2f} ms per step ({args.batch * 1e3 / ms:8.0f} tokens/s)")
    print(f"absorbed is {med['expanded'] / med['absorbed']:.2f}x faster than expanded")


if __name__ == "__main__":
    main()
