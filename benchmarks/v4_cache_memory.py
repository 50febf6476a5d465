"""DeepSeek-V4's KV cache per token, as this engine lays it out, from the layers' cache specs of the real-shape model
(transformers' default ``DeepseekV4Config``, or a checkpoint's config.json) built on the meta device.

    .venv/bin/python -m benchmarks.v4_cache_memory [--model DIR]

Per token, the paged cache holds each compressed layer's share of its compressed entries (one of ``head_dim``
values per ``m`` tokens, spread over the window's slots; CSA's indexer entries beside them); each running request
also holds a state of fixed size: every layer's key rows for the sliding window and its compressors' raw rows of the
windows not yet complete (``engine.layers.compressed_attention``, ``engine.layers.window_rings``). Also printed:
the goal (the compressed entries alone, unpadded) and what the former layout took (a key row and the compressors'
raw rows per token and layer, the entries recomputed each step).
"""

import argparse
from collections import Counter

import torch

from engine.core.model_config import load_model_config, model_config_from_hf
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
    state = sum(attn.state_spec().bytes_per_slot(dtype) for attn in layers)
    print(f"{config.num_layers} layers ({', '.join(f'{n} {k}' for k, n in kinds.items())}), head_dim "
          f"{config.head_dim}, window {config.cfg('sliding_window')}, {dtype}")
    for kind in kinds:
        attn = next(a for a in layers if a.kind == kind)
        rings = ", ".join(f"{r.size}x{r.width}" for r in attn.rings())
        print(f"  {kind}: {attn.cache_spec().values_per_token()} values/token {attn.cache_spec().per_token}; "
              f"state rings (rows x values) {rings}")
    goal = 0.0  # the compressed entries alone, bytes per token
    former = 0  # a key row and the compressors' raw rows per token, as the engine cached before
    for attn in layers:
        former += attn.head_dim * dtype.itemsize
        for c in attn.compressors():
            goal += c.width * dtype.itemsize / c.rate
            former += c.raw_width() * dtype.itemsize
    print(f"this engine's layout: {total / 1024:.2f} KiB/token, all layers (goal, the entries unpadded: "
          f"{goal / 1024:.2f} KiB/token), plus {state / 2**20:.2f} MiB of state per running request")
    print(f"former layout (raw rows per token, entries recomputed each step): {former / 1024:.1f} KiB/token, "
          f"{former / total:.0f}x more")
    for length in (8192, 131072, 1048576):
        print(f"  a {length}-token request: {(length * total + state) / 2**20:.1f} MiB here, "
              f"{length * former / 2**20:.1f} MiB before")


if __name__ == "__main__":
    main()
