"""Tiny checkpoints with INT4 routed experts in compressed-tensors' pack-quantized layout, as Kimi-K2-Thinking,
Kimi-K2.5 and Kimi-K2.6 publish theirs: each routed expert's weight quantized by compressed-tensors' own minmax
parameters and compressor (``weight_packed`` int32, ``weight_scale`` bfloat16, ``weight_shape``), everything else
as it was, and the published ``quantization_config``."""

import json
import os

import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file, save_file

WEIGHTS = dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32, dynamic=False, actorder=None,
               observer="minmax", observer_kwargs={}, block_structure=None)
SCHEME = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**{
    k: WEIGHTS[k] for k in ("num_bits", "type", "symmetric", "strategy", "group_size")}))
# Kimi-K2-Thinking's and Kimi-K2.5's quantization_config (its "ignore" keeps attention, shared experts, dense MLPs,
# the LM head and Kimi-K2.5's vision tower and projector in bfloat16; the router is no Linear layer there).
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": WEIGHTS}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*vision_tower.*", "re:.*mm_projector.*"],
    "kv_cache_scheme": None,
}


def is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name and name.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight"))


def compress(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """One weight [N, K] -> {weight_packed, weight_scale, weight_shape}: compressed-tensors' minmax scales per group
    of 32 (in bfloat16, the published scales' dtype) and its compressor, on the bfloat16 weight."""
    groups = w.unflatten(-1, (-1, 32))  # [N, K/32, 32]
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), SCHEME.weights)
    return dict(PackedQuantizationCompressor.compress(
        {"weight": w.to(torch.bfloat16), "weight_scale": scale.to(torch.bfloat16)}, SCHEME))


def decompressed(stored: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """compressed-tensors' own decompression of ``<prefix>.weight_*`` -> the bfloat16 weight [N, K]."""
    local = {k[len(prefix) + 1:]: v for k, v in stored.items() if k.startswith(prefix + ".weight_")}
    return PackedQuantizationCompressor.decompress(local, SCHEME)["weight"]


def write_int4(src: str, dst: str, config_update: dict | None = None) -> dict[str, torch.Tensor]:
    """``src``'s checkpoint with its routed experts INT4 (compressed-tensors) into ``dst``, config.json with the
    published quantization_config (and ``config_update``); returns the tensors written."""
    stored = {}
    for name, w in load_file(os.path.join(src, "model.safetensors")).items():
        if is_routed_expert(name):
            stored.update({f"{name[:-len('.weight')]}.{k}": v for k, v in compress(w).items()})
        else:
            stored[name] = w
    os.makedirs(dst, exist_ok=True)
    save_file(stored, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    for extra in os.listdir(src):  # tokenizer and generation files travel along
        if extra not in ("model.safetensors", "config.json") and os.path.isfile(os.path.join(src, extra)):
            with open(os.path.join(src, extra), "rb") as f, open(os.path.join(dst, extra), "wb") as g:
                g.write(f.read())
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config.update(quantization_config=QUANTIZATION_CONFIG, **(config_update or {}))
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return stored


def float_experts_(model: torch.nn.Module) -> None:
    """transformers keeps decompressed experts in bfloat16 in a float32 model (and refuses ``.float()`` on a quantized
    model): widen them, exactly, so the reference runs in float32 as the engine does."""
    torch.nn.Module.float(model)
