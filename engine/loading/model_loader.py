"""Build a model from a local Hugging Face checkpoint directory (config.json + safetensors shards).

``rank_part``, ``held_elsewhere``, ``part_of`` and ``copy_into`` say how one checkpoint tensor becomes this rank's
slice of a parameter; random-weight models (``engine.loading.random_weights``) are cut by the same functions, so a
split random model holds exactly the slices of the unsplit one.
"""

import glob
import json
import logging
import os
from collections.abc import Callable

import torch

from engine.distributed.collectives import SINGLE, TensorParallel
from engine.distributed.pipeline import WHOLE, PipelineStage
from engine.layers.clamped_moe import ClampedMoeBlock
from engine.layers.moe import ExpertWeights, SparseMoeBlock
from engine.layers.rank_slices import RowRuns
from engine.layers.rotary import RotaryEmbedding
from engine.loading import compressed_tensors, mxfp4
from engine.core.model_config import CheckpointError, ModelConfig
from engine.loading.quantization import (
    CHECKPOINT_8BIT, checkpoint_scheme, dequantize_checkpoint_tensor, is_scale_name, quantize_experts_, scale_name,
)
from engine.models import MoECausalLM, model_class
from engine.models.base import WeightRule
from moe_kernels.quant import QuantScheme

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


_EXPERT_TENSORS = (".experts.w13", ".experts.w2", ".experts.w13_bias", ".experts.w2_bias")


def rank_part(target: str, rule: WeightRule, shape: list[int], model: MoECausalLM):
    """The part of a checkpoint tensor of ``shape`` this tensor-parallel rank holds, as a safetensors slice
    index (a tuple of slices, a list of them to concatenate along dim 1, or ``RowRuns`` to concatenate along
    dim 0), or None for the whole tensor."""
    tp = model.tp
    if tp.expert_parallel is not None and target.endswith(_EXPERT_TENSORS):
        if rule.shard == "expert":
            return None  # one expert's tensor, whole (``held_elsewhere`` skips those of other ranks' experts)
        block = _moe_block(model, target)  # packed [E, 2I, H] / [E, H, I]: this rank's run of experts
        return (slice(block.first_expert, block.first_expert + block.experts.w13.shape[0]),)
    if tp.size == 1:
        return None
    for mixer in (".self_attn.", ".linear_attn."):  # a mixer that says how it is split (MLA, linear attention)
        if mixer in target:
            layer, _, local = target.partition(mixer)
            own = getattr(model.get_submodule(layer + mixer[:-1]), "tp_slices", None)
            if own is not None:
                return own(local, tp.rank)
    attn, r = _attention_of(model, target), tp.rank
    d = getattr(attn, "head_dim", None)  # read below for a standard attention's own tensors only (MLA split above)

    def rows(start: int, n: int):
        return (slice(start, start + n),)

    def cols(start: int, n: int, dim: int = 1):
        return (slice(None),) * dim + (slice(start, start + n),)

    if rule.shard == "q":
        return rows(r * attn.num_heads * d, attn.num_heads * d)
    if rule.shard in ("k", "v"):
        replicated = attn.total_kv_heads < tp.size
        first = r * attn.total_kv_heads // tp.size if replicated else r * attn.num_kv_heads
        width = d if rule.shard == "k" else attn.v_head_dim
        return rows(first * width, attn.num_kv_heads * width)
    if target.endswith("o_proj.weight"):
        width = attn.num_heads * attn.v_head_dim
        return cols(r * width, width)
    if target.endswith((".self_attn.sinks", ".self_attn.g_proj.weight")):  # [h] / [h, H]: one per query head
        return rows(r * attn.num_heads, attn.num_heads)
    if target.endswith(".experts.w2_bias"):
        return None  # [E, H]: whole on every rank, added by rank 0 (``SparseMoeBlock``)
    if target.endswith(_EXPERT_TENSORS) and rule.shard != "expert":  # packed [E, 2I, H] / [E, H, I] / [E, 2I]
        if rule.shard in (0, 1):  # every expert's gate or up rows, stacked [E, I, H] (Step-3.7-Flash)
            n = shape[1] // tp.size
            return cols(r * n, n)
        if target.endswith("w2"):
            n = shape[2] // tp.size
            return cols(r * n, n, dim=2)
        size = shape[1] // 2
        n = size // tp.size
        return [cols(r * n, n), cols(size + r * n, n)]
    if rule.shard in (0, 1) or (rule.shard == "expert" and rule.half is not None):  # a gate or up [I, H]
        n = shape[0] // tp.size
        return rows(r * n, n)
    if target.endswith("down_proj.weight") or (rule.shard == "expert" and rule.half is None):  # [H, I]
        n = shape[1] // tp.size
        return cols(r * n, n)
    if target in ("model.embed_tokens.weight", "lm_head.weight"):
        n = model.model.embed_tokens.rows
        return rows(r * n, max(0, min(n, shape[0] - r * n)))
    return None  # norms, routers, shared-expert gates: every rank holds them whole


def _attention_of(model: MoECausalLM, target: str):
    """The attention block of the layer ``target`` names (layers may differ in heads and head widths), or the
    first layer's for a tensor outside attention."""
    layer, inside, _ = target.partition(".self_attn.")
    return model.get_submodule(layer + ".self_attn") if inside else model.attention_layers()[0]


def _moe_block(model: MoECausalLM, target: str) -> SparseMoeBlock:
    return model.get_submodule(target.rsplit(".experts.", 1)[0])


def held_elsewhere(target: str, rule: WeightRule, match, model: MoECausalLM) -> bool:
    """True for one expert's tensor when another expert-parallel rank holds that expert (not read here)."""
    if model.tp.expert_parallel is None or rule.shard != "expert":
        return False
    block = _moe_block(model, target)
    return not 0 <= int(match.group(2)) - block.first_expert < block.experts.w13.shape[0]


def part_of(source, part) -> torch.Tensor:
    """``part`` (a ``rank_part`` index, not None) of a tensor or of a safetensors slice (which reads only it)."""
    if isinstance(part, RowRuns):
        return torch.cat([source[index] for index in part], dim=0)
    if isinstance(part, list):
        return torch.cat([source[index] for index in part], dim=1)
    return source[part]


def _read(f, name: str, part) -> torch.Tensor:
    """This rank's part of checkpoint tensor ``name`` (only that part is read from the file)."""
    if part is None:
        return f.get_tensor(name)
    return part_of(f.get_slice(name), part)


class _Scales:
    """Reads the scale of an 8-bit checkpoint tensor, from whichever shard holds it."""

    def __init__(self, files: list[str], block: tuple[int, int] | None) -> None:
        from safetensors import safe_open

        self.block, self.where = block, {}
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                self.where.update(dict.fromkeys(f.keys(), path))

    def dequantized(self, f, name: str, part, path: str) -> torch.Tensor:
        """This rank's part of 8-bit tensor ``name`` in float32 (the whole tensor is read: block scales do not
        slice along with arbitrary rank parts)."""
        from safetensors import safe_open

        scale_key = scale_name(name, self.where)
        if scale_key is None:
            raise CheckpointError(f"{path}: 8-bit tensor {name} has no {name}_scale_inv or {name}_scale")
        with safe_open(self.where[scale_key], framework="pt", device="cpu") as g:
            scale = g.get_tensor(scale_key)
        full = dequantize_checkpoint_tensor(f.get_tensor(name), scale, self.block, name, path)
        return full if part is None else part_of(full, part)


def _copy_int4(f, name: str, kind: str, params: dict, model: MoECausalLM, path: str, wrote) -> None:
    """A compressed-tensors INT4 tensor (``kind`` "packed" or "scale") into this rank's part of its experts'
    packed weight or scales, as stored (``moe_kernels.int4``'s layout is the checkpoint's)."""
    target, rule, match = model.map_weight_name(compressed_tensors.weight_name(name))
    if not target.endswith((".experts.w13", ".experts.w2")) or target not in params:
        raise CheckpointError(f"{path}: {name} is INT4, but only the routed experts' weights are served packed "
                              "(list the other layers in quantization_config.ignore)")
    if held_elsewhere(target, rule, match, model):
        return
    info = f.get_slice(name)
    want = {"packed": "I32", "scale": "BF16"}[kind]  # the scales are kept in bfloat16, as published
    if info.get_dtype() != want:
        raise CheckpointError(f"{path}: {name} is {info.get_dtype()}, expected {want} (compressed-tensors INT4 "
                              "experts as Kimi publishes them)")
    param = target if kind == "packed" else target + "_scale"
    # The part is cut by the stored tensor's own shape: along N as a float weight's, along K in packed words or
    # scale columns, which match as long as each rank's K holds whole groups of 32 (``check_int4_split``).
    tensor = _read(f, name, rank_part(target, rule, info.get_shape(), model))
    wrote(param, copy_into(params[param].data, tensor, rule, match, model, name, path))


def copy_into(param: torch.Tensor, tensor: torch.Tensor, rule: WeightRule, match, model: MoECausalLM, name: str, path: str) -> int:
    """Copy one checkpoint tensor (this rank's part of it) into its slice of a parameter; returns elements written."""
    if rule.shard in _QKV_ORDER:
        attn = _attention_of(model, match.expand(rule.target))
        start = {"q": 0, "k": attn.q_size, "v": attn.q_size + attn.kv_size}[rule.shard]
        dest = param.narrow(0, start, {"q": attn.q_size, "k": attn.kv_size, "v": attn.v_size}[rule.shard])
    elif rule.shard == "expert":
        block = model.get_submodule(match.group(1))  # the MoE block holding this expert
        expert = int(match.group(2))
        if expert >= block.expert_tokens.shape[0]:
            raise CheckpointError(f"{path}: tensor {name} names expert {expert} but the config has "
                                  f"{block.expert_tokens.shape[0]}")
        dest = param[expert - block.first_expert]
        if rule.half is not None:
            half = dest.shape[0] // 2
            dest = dest.narrow(0, rule.half * half, half)
    elif rule.shard in (0, 1):
        rows = 1 if param.dim() == 3 else 0  # w13 [E, 2I, H]: every expert's gate or up rows, from a stack of them
        half = param.shape[rows] // 2
        dest = param.narrow(rows, rule.shard * half, half)
    else:
        dest = param
    full = dest
    if model.tp.size > 1 and tensor.dim() and tensor.shape[1:] == dest.shape[1:] and tensor.shape[0] < dest.shape[0]:
        dest[tensor.shape[0]:].zero_()  # the last rank's vocabulary rows past the end of the vocabulary
        dest = dest[:tensor.shape[0]]
    if tuple(dest.shape) != tuple(tensor.shape):
        raise CheckpointError(f"{path}: tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(tensor)
    return full.numel()


def load_weights(model: MoECausalLM, model_dir: str, on_complete: Callable[[str], None] | None = None) -> None:
    """Fill every parameter from the checkpoint; a missing or misshapen tensor is a CheckpointError.

    ``on_complete(name)`` runs once a parameter has all its values; the caller may then replace it (e.g. by its
    quantized form): the loader keeps no reference to a completed parameter, so its memory can go back at once."""
    from safetensors import SafetensorError, safe_open

    params = dict(model.named_parameters())
    sizes = {name: p.numel() for name, p in params.items()}
    written = {name: 0 for name in params}

    def wrote(target: str, count: int) -> None:
        written[target] += count
        if on_complete is not None and written[target] >= sizes[target]:
            del params[target]  # no reference kept: a replaced parameter's memory goes back now
            on_complete(target)

    files = checkpoint_files(model_dir)
    stored = checkpoint_scheme(model.config)
    int4 = stored is not None and stored.method == "int4"  # compressed-tensors: experts read packed, as stored
    scales = _Scales(files, stored.block) if stored is not None and not int4 else None
    extra = 0  # tensors of layers past the last one (next-token-prediction layers)
    fp4 = mxfp4.Mxfp4Reader(files) if mxfp4.declared(model.config) else None
    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if scales is not None and is_scale_name(name):
                        continue  # read with the weight it scales
                    if model.extra_layer(name):
                        extra += 1
                        continue
                    if model.on_other_stage(name):  # another pipeline stage's layer: never read here
                        continue
                    kind = compressed_tensors.tensor_kind(name) if int4 else None
                    if kind == "shape":
                        continue  # [N, K], which the packed tensor's and the parameter's shapes already say
                    if kind is not None:
                        _copy_int4(f, name, kind, params, model, path, wrote)
                        continue
                    if fp4 is not None and fp4.is_scales(name):
                        continue  # read with its MXFP4 blocks
                    target, rule, match = model.map_weight_name(mxfp4.weight_name(name))
                    if target not in params:
                        logger.warning("%s: ignoring tensor %s (no matching parameter)", path, name)
                        continue
                    if held_elsewhere(target, rule, match, model):
                        continue
                    info = f.get_slice(name)
                    layout = model.checkpoint_layout(name)
                    packed_fp4 = fp4 is not None and mxfp4.is_blocks(name)
                    if layout is not None or packed_fp4:  # read whole, brought to our layout, then cut
                        whole = fp4.dequantized(f, name, path) if packed_fp4 else f.get_tensor(name)
                        whole = whole if layout is None else layout(whole)
                        part = rank_part(target, rule, list(whole.shape), model)
                        tensor = whole if part is None else part_of(whole, part)
                        wrote(target, copy_into(params[target].data, tensor, rule, match, model, name, path))
                        continue
                    part = rank_part(target, rule, info.get_shape(), model)
                    if info.get_dtype() in CHECKPOINT_8BIT:
                        if scales is None:
                            raise CheckpointError(f"{path}: tensor {name} is {info.get_dtype()} but config.json has "
                                                  "no quantization_config")
                        tensor = scales.dequantized(f, name, part, path)
                    else:
                        tensor = _read(f, name, part)
                    wrote(target, copy_into(params[target].data, tensor, rule, match, model, name, path))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: cannot read safetensors ({str(e).splitlines()[0]})") from None
    if extra:
        logger.info("%s: skipped %d tensors of layers past num_hidden_layers=%d (next-token-prediction layers) "
                    "or of a vision tower, not used for serving", model_dir, extra, model.config.num_layers)
    if model.config.tie_word_embeddings and "lm_head.weight" in written:
        written["lm_head.weight"] = written.get("model.embed_tokens.weight", 0)
    missing = [n for n, size in sizes.items() if written.get(n, 0) < size]
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise CheckpointError(f"{model_dir}: checkpoint lacks weights for {shown}")


def _rebuild_buffers(model: MoECausalLM) -> None:
    """Non-persistent buffers were meta, and are uninitialised once materialised: compute them again."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.build_cache()
        elif isinstance(module, (SparseMoeBlock, ClampedMoeBlock)):
            module.expert_tokens.zero_()


def build_model(config: ModelConfig, model_dir: str, dtype: torch.dtype, device: torch.device, moe_backend: str,
                max_positions: int, tp: TensorParallel = SINGLE, quantization: QuantScheme | None = None,
                stage: PipelineStage = WHOLE) -> MoECausalLM:
    """Instantiate our family class for the checkpoint and load its weights (this rank's slices; with
    ``stage``, only its pipeline stage's layers).

    Without ``quantization`` the model is allocated once, on ``device`` in ``dtype`` (the cast is free on the
    meta device; parameters kept in float32 stay so), and each checkpoint tensor is copied into its place as it
    is read: the host holds one checkpoint tensor at a time (an MXFP4 or 8-bit one dequantized to float32), never
    the model. Each copy rounds the tensor to ``dtype`` exactly as a cast of the whole model would.

    With ``quantization`` the routed experts are quantized from the float32 weights on the CPU, before the
    move, so the device never holds them in 16 bits: the model is laid out on the CPU in float32 (memory taken as
    tensors are written) and each layer's experts are quantized, and their float32 freed, as soon as read. An
    8-bit checkpoint's tensors are dequantized as they are read (float32, exact for its float8 values times
    float32 scales up to float32 rounding); its experts are then quantized again with the scheme asked for, which
    for the checkpoint's own scheme gives back its values.

    An INT4 (compressed-tensors) checkpoint's experts are allocated packed (int32 words and bfloat16 scales, 4.5
    bits a weight) and each tensor copied into them as stored: a 1T-parameter Kimi model never exists in 16 bits.
    """
    cls = model_class(config)
    with torch.device("meta"):
        model = cls(config, moe_backend=moe_backend, max_positions=max_positions, tp=tp, stage=stage)
    as_stored = quantization is not None and quantization.method == "int4"  # only a checkpoint's own (INT4)
    if as_stored:
        quantize_experts_(model, quantization)  # on meta: the packed shapes, filled straight from the checkpoint
        quantization = None  # then loaded as an unquantized model is: no float32 copy anywhere
    if quantization is None:
        model = model.to(dtype=dtype).to_empty(device=device)
    else:  # float32 on the CPU, loaded, quantized, then cast and moved once
        model = model.to_empty(device="cpu")
    if config.tie_word_embeddings and stage.is_first:  # to_empty may give the two names separate storage
        model.lm_head.weight = model.model.embed_tokens.weight
    _rebuild_buffers(model)
    if quantization is None:
        load_weights(model, model_dir)
        return model.to(dtype=dtype).eval()  # the parameters are in dtype already: this casts the float32 buffers
    # Each MoE layer's experts are quantized as soon as both their tensors are read, and their float32 copies
    # freed: the host holds the quantized experts, one layer's float32 experts and the rest of the model, never
    # every expert in float32 (on the CPU, memory is taken as tensors are first written).
    expert_modules = {f"{name}.{w}": module for name, module in model.named_modules()
                      if isinstance(module, ExpertWeights) for w in ("w13", "w2")}
    read: dict[int, set[str]] = {}

    def quantize_when_read(param: str) -> None:
        module = expert_modules.get(param)
        if module is not None:
            read.setdefault(id(module), set()).add(param.rsplit(".", 1)[1])
            if read[id(module)] == {"w13", "w2"}:
                module.quantize_(quantization)

    load_weights(model, model_dir, quantize_when_read)
    quantize_experts_(model, quantization)  # (any not yet: none after a complete load)
    return model.to(device=device, dtype=dtype).eval()
