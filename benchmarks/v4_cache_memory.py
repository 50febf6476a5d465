"""DeepSeek-V4's KV cache per token, as this engine lays it out, from the layers' cache specs of the real-shape model
(transformers' default ``DeepseekV4Config``, or a checkpoint's config.json) built on the meta device.

    .venv/bin/python -m benchmarks.v4_cache_memory [--model DIR]

Each layer caches per token its key row and, for compressed layers, the compressor's (and CSA's indexer's) raw
projections, from which each step recomputes the compressed entries (``engine.layers.compressed_attention``). Also
printed: what an incremental layout would take (the compressed entries kept, 1 per ``m`` tokens, the key rows only
within the window), the goal for a cache that keeps the compressor's state across steps.
"""

import argparse
from collections import Counter

import torch

from engine.core.model_config import load_model_config, model_config_from_hf
from engine.layers.compressed_attention import CSA, SLIDING
from engine.models.deepseek_v4 import DeepseekV4ForCausalLM


def v4_config(model_dir: str | None):
    if model_dir:
        return load_model_config(model_dir)
    from transformers import DeepseekV4Config

    return model_config_from_hf("DeepseekV4ForCausalLM", DeepseekV4Config(), [1], torch_dtype="bfloat16")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a checkpoint directory (default: transformers' default config)")
    args = p.parse_args()
    dtype = torch.bfloat16
    config = v4_config(args.model)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config, "torch", max_positions=1)
    layers = model.attention_layers()
    kinds = Counter(attn.kind for attn in layers)
    total = sum(attn.cache_spec().bytes_per_token(dtype) for attn in layers)
    print(f"{config.num_layers} layers ({', '.join(f'{n} {k}' for k, n in kinds.items())}), head_dim "
          f"{config.head_dim}, {dtype}")
    for kind in kinds:
        attn = next(a for a in layers if a.kind == kind)
        print(f"  {kind}: {attn.cache_spec().values_per_token()} values/token ({attn.cache_spec().per_token})")
    print(f"this engine's layout: {total / 1024:.1f} KiB/token, all layers")
    incremental = 0.0  # bytes per token once the context is far longer than the window
    for attn in layers:
        if attn.kind == SLIDING:
            continue
        incremental += attn.head_dim * dtype.itemsize / attn.compressor.rate
        if attn.kind == CSA:
            incremental += attn.compressor.indexer.head_dim * dtype.itemsize / attn.compressor.rate
    print(f"incremental layout (compressed entries kept; window rows and compressor tails per request, not per "
          f"token): {incremental / 1024:.2f} KiB/token, {total / incremental:.0f}x less")


if __name__ == "__main__":
    main()
