"""Build a model from a local Hugging Face checkpoint directory (config.json + safetensors shards)."""

import glob
import json
import logging
import os

import torch

from engine.layers.moe import SparseMoeBlock
from engine.layers.rotary import RotaryEmbedding
from engine.loading.model_config import CheckpointError, ModelConfig
from engine.models import MODEL_REGISTRY, MoECausalLM
from engine.models.base import WeightRule

logger = logging.getLogger(__name__)

_QKV_ORDER = ("q", "k", "v")


def checkpoint_files(model_dir: str) -> list[str]:
    """The safetensors files to read: those named by the index if there is one, else every *.safetensors."""
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: not a valid safetensors index ({e!r})") from None
        files = sorted({os.path.join(model_dir, name) for name in weight_map.values()})
        for path in files:
            if not os.path.exists(path):
                raise CheckpointError(f"{path}: shard listed in model.safetensors.index.json is missing")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weights found")
    return files


def _copy_into(param: torch.Tensor, tensor: torch.Tensor, rule: WeightRule, match, model: MoECausalLM, name: str, path: str) -> int:
    """Copy one checkpoint tensor into its (slice of a) parameter; returns elements written."""
    c = model.config
    if rule.shard in _QKV_ORDER:
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        start = {"q": 0, "k": q, "v": q + kv}[rule.shard]
        dest = param.narrow(0, start, q if rule.shard == "q" else kv)
    elif rule.shard == "expert":
        expert = int(match.group(2))
        if expert >= param.shape[0]:
            raise CheckpointError(f"{path}: tensor {name} names expert {expert} but the config has {param.shape[0]}")
        dest = param[expert]
        if rule.half is not None:
            half = dest.shape[0] // 2
            dest = dest.narrow(0, rule.half * half, half)
    elif rule.shard in (0, 1):
        half = param.shape[0] // 2
        dest = param.narrow(0, rule.shard * half, half)
    else:
        dest = param
    if tuple(dest.shape) != tuple(tensor.shape):
        raise CheckpointError(f"{path}: tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(tensor)
    return dest.numel()


def load_weights(model: MoECausalLM, model_dir: str) -> None:
    """Fill every parameter from the checkpoint; a missing or misshapen tensor is a CheckpointError."""
    from safetensors import SafetensorError, safe_open

    params = dict(model.named_parameters())
    written = {name: 0 for name in params}
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    target, rule, match = model.map_weight_name(name)
                    if target not in params:
                        logger.warning("%s: ignoring tensor %s (no matching parameter)", path, name)
                        continue
                    written[target] += _copy_into(params[target].data, f.get_tensor(name), rule, match, model, name, path)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: cannot read safetensors ({str(e).splitlines()[0]})") from None
    if model.config.tie_word_embeddings:
        written["lm_head.weight"] = written.get("model.embed_tokens.weight", 0)
    missing = [n for n, p in params.items() if written.get(n, 0) < p.numel()]
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise CheckpointError(f"{model_dir}: checkpoint lacks weights for {shown}")


def build_model(config: ModelConfig, model_dir: str, dtype: torch.dtype, device: torch.device, moe_backend: str, max_positions: int) -> MoECausalLM:
    """Instantiate our family class for the checkpoint, load its weights, cast and move it."""
    cls = MODEL_REGISTRY[config.architecture]
    with torch.device("meta"):
        model = cls(config, moe_backend=moe_backend, max_positions=max_positions)
    # Materialise on the CPU in float32, load, then cast once: loading stays simple and exact.
    model = model.to_empty(device="cpu")
    for module in model.modules():  # non-persistent buffers were meta, now uninitialised: rebuild them
        if isinstance(module, RotaryEmbedding):
            module.build_cache()
        elif isinstance(module, SparseMoeBlock):
            module.expert_tokens.zero_()
    load_weights(model, model_dir)
    return model.to(device=device, dtype=dtype).eval()
