"""The latent KV cache's memory: tokens that fit in one pool with MLA's latent rows vs the same model's expanded
per-head K and V, read from the layers' cache specs of the real-shape model built on the meta device.

    .venv/bin/python -m benchmarks.mla_cache_memory --model deepseek-v3 --pool-gb 80

Goal: ``heads x (qk_head_dim + v_head_dim) / (kv_lora_rank + rope_dim)`` times the tokens (71x for DeepSeek-V3),
to within block rounding.
"""

import argparse

import torch

from engine.layers.cache_spec import CacheSpec
from engine.loading.random_weights import build_random_model, random_model_config
from engine.worker.cache_groups import kv_bytes_per_block


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deepseek-v3", help="a random-weight spec of an MLA model")
    p.add_argument("--pool-gb", type=float, default=80.0)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args()
    dtype = torch.bfloat16
    config = random_model_config(args.model)
    model = build_random_model(config, dtype, torch.device("meta"), "torch", max_positions=1)
    layers = model.attention_layers()
    attn = layers[0]
    # What the same layers would cache with K and V expanded per head (as a standard attention cache would).
    expanded = CacheSpec(((attn.num_heads, attn.qk_dim), (attn.num_heads, attn.v_dim)))
    budget = int(args.pool_gb * 2**30)
    latent_block = kv_bytes_per_block(model, args.block_size, dtype)
    expanded_block = args.block_size * len(layers) * expanded.bytes_per_token(dtype)
    latent_tokens = budget // latent_block * args.block_size
    expanded_tokens = budget // expanded_block * args.block_size
    goal = expanded.values_per_token() / attn.cache_spec().values_per_token()
    print(f"{args.model}: {len(layers)} layers, {attn.num_heads} heads; per token and layer: latent "
          f"{attn.cache_spec().values_per_token()} values, expanded K/V {expanded.values_per_token()} values ({dtype})")
    print(f"pool {args.pool_gb:g} GiB, blocks of {args.block_size}: MLA latent cache {latent_tokens:,} tokens "
          f"({latent_block / args.block_size / 1024:.1f} KiB/token), expanded K/V {expanded_tokens:,} tokens "
          f"({expanded_block / args.block_size / 1024:.1f} KiB/token)")
    print(f"ratio {latent_tokens / expanded_tokens:.2f}x (goal {goal:.2f}x)")


if __name__ == "__main__":
    main()
