"""KV cache bytes per token of the published DeepSeek shapes, read from the engine's own cache specs (the real-shape
model built on the meta device: no memory, no weights), beside the figures their authors publish.

    .venv/bin/python -m benchmarks.kv_bytes_per_token

Authors' figures (per token and layer): DeepSeek-V3's MLA caches one 576-value latent row (512 + 64 rotary) in
bf16: 1,152 bytes. DeepSeek-V3.2's sparse-attention kernels (FlashMLA's FP8 format) cache the 512 latent values
in FP8 with four float32 scales and the 64 rotary values in bf16: 656 bytes, and the lightning indexer's
128-value key in FP8 with one float32 scale: 132 bytes. The engine keeps both in the model's dtype, or in that FP8
format with ``--kv-cache-dtype fp8`` (``engine.layers.fp8_cache``): a second row for the models that have it.
"""

import argparse

import torch

from engine.core.family_support import FP8_CACHE_ARCHITECTURES
from engine.loading.random_weights import build_random_model, random_model_config

# spec -> (the authors' bytes per token and layer, where the figure comes from)
PUBLISHED = {
    "deepseek-v3": (576 * 2, "MLA latent 512 + rope 64, bf16"),
    "deepseek-v3.2": (656 + 132, "FP8 latent 512 + 4 fp32 scales + bf16 rope 64 (656), FP8 indexer key + scale (132)"),
}


def bytes_per_token(spec: str, dtype: torch.dtype, fp8: bool = False) -> tuple[int, int, str]:
    """(cache layers, bytes per token over all of them, the first layer's per-token entries) of ``spec``, with the
    FP8 cache where ``fp8`` (as ``--kv-cache-dtype fp8`` sets it)."""
    model = build_random_model(random_model_config(spec), dtype, torch.device("meta"), "torch", max_positions=1)
    layers = model.attention_layers()
    for layer in layers:
        layer.fp8_cache = fp8
    total = sum(layer.cache_spec().bytes_per_token(dtype) for layer in layers)
    return len(layers), total, str(layers[0].cache_spec().per_token)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(PUBLISHED), help="comma-separated random-weight presets")
    args = p.parse_args()
    print(f"{'model':<16}{'cache':>6}{'layers':>7}{'engine B/token':>16}{'engine B/layer':>16}"
          f"{'authors B/layer':>17}  ratio")
    for spec in args.models.split(","):
        kinds = ["bf16"]
        if random_model_config(spec).architecture in FP8_CACHE_ARCHITECTURES:
            kinds.append("fp8")
        for kind in kinds:
            layers, total, entries = bytes_per_token(spec, torch.bfloat16, fp8=kind == "fp8")
            published, source = PUBLISHED.get(spec, (None, ""))
            ratio = f"{total / layers / published:.2f}x" if published else "-"
            print(f"{spec:<16}{kind:>6}{layers:>7}{total:>16,}{total / layers:>16,.0f}{published or '-':>17}  {ratio}"
                  f"  entries {entries}; authors: {source}")


if __name__ == "__main__":
    main()
