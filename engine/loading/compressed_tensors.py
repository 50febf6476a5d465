"""Checkpoints in compressed-tensors' ``pack-quantized`` INT4 format: Kimi-K2-Thinking, Kimi-K2.5 and Kimi-K2.6
publish their routed experts so, every other weight in bfloat16.

config.json carries::

    "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
      "quantization_status": "compressed",
      "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null,
        "weights": {"num_bits": 4, "type": "int", "symmetric": true, "strategy": "group", "group_size": 32, ...}}},
      "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", ...]}

and each quantized linear layer ``<prefix>.weight`` is stored as ``<prefix>.weight_packed`` (int32 [N, K/8]),
``<prefix>.weight_scale`` (bfloat16 [N, K/32]) and ``<prefix>.weight_shape`` ([N, K]); the layout is
``moe_kernels.int4``'s. Served: 4-bit signed integers, symmetric, one scale per group of 32 input channels, weights
only, on the routed experts; anything else in ``quantization_config`` is refused with one line naming the field.
The experts are loaded packed as they are stored (``engine.loading.model_loader``), never widened to 16 bits.
"""

from engine.core.model_config import CheckpointError
from moe_kernels.int4 import GROUP_SIZE

QUANT_METHOD = "compressed-tensors"
PACKED, SCALE, SHAPE = "weight_packed", "weight_scale", "weight_shape"
# Fields of a group's "weights" that decide how values are stored, with the only values served.
_SERVED_WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP_SIZE}


def _refuse(field: str, value, served: str) -> CheckpointError:
    return CheckpointError(f"config.json quantization_config.{field} {value!r} is not supported: compressed-tensors "
                           f"checkpoints are served with {served}")


def check_config(qc: dict) -> None:
    """CheckpointError naming the field unless ``qc`` (a ``quant_method: compressed-tensors`` quantization_config)
    is weight-only INT4, symmetric, in groups of 32, packed."""
    fmt = qc.get("format")
    if fmt != "pack-quantized":
        raise _refuse("format", fmt, "format 'pack-quantized' (INT4 experts, as Kimi-K2.5 publishes them)")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse("quantization_status", status, "quantization_status 'compressed' (packed weights)")
    if qc.get("kv_cache_scheme") is not None:
        raise _refuse("kv_cache_scheme", qc["kv_cache_scheme"], "kv_cache_scheme null (use --kv-cache-dtype)")
    for extra in ("sparsity_config", "transform_config"):  # sparse or rotated weights: not stored as read here
        if qc.get(extra):
            raise _refuse(extra, qc[extra], f"{extra} null")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse("config_groups", groups, "one or more groups of INT4 weights")
    for name, group in groups.items():
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise _refuse(f"config_groups.{name}.weights", None if not isinstance(group, dict) else group.get("weights"),
                          "INT4 weights in every group")
        if group.get("format", fmt) != fmt:
            raise _refuse(f"config_groups.{name}.format", group["format"], "format 'pack-quantized'")
        for side in ("input_activations", "output_activations"):
            if group.get(side) is not None:
                raise _refuse(f"config_groups.{name}.{side}", group[side], f"{side} null (weight-only)")
        weights = group["weights"]
        for field, served in _SERVED_WEIGHTS.items():
            if weights.get(field) != served:
                raise _refuse(f"config_groups.{name}.weights.{field}", weights.get(field),
                              f"weights {field} {served!r} (4-bit symmetric integers, one scale per 32 input channels)")
        if weights.get("actorder") not in (None, "weight"):  # "group" stores a g_idx permutation: not read here
            raise _refuse(f"config_groups.{name}.weights.actorder", weights["actorder"], "actorder null or 'weight'")


def tensor_kind(name: str) -> str | None:
    """"packed", "scale" or "shape" for a checkpoint tensor of a quantized layer, None for any other tensor."""
    for kind, suffix in (("packed", PACKED), ("scale", SCALE), ("shape", SHAPE)):
        if name.endswith("." + suffix):
            return kind
    return None


def weight_name(name: str) -> str:
    """The ``<prefix>.weight`` a ``<prefix>.weight_packed`` or ``<prefix>.weight_scale`` tensor stores."""
    return name.rsplit(".", 1)[0] + ".weight"
