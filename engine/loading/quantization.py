"""Quantized routed experts: which scheme a deployment runs, whether its device can, and checkpoints stored in 8 bits.

``--quantization`` names the scheme (``QUANTIZATION_OPTIONS``): "fp8" (float8_e4m3fn, one scale per output
channel), "fp8-block" (float8_e4m3fn, one scale per 128x128 block), "int8" (int8 weight-only, one scale per
output channel), "mxfp4" (4-bit e2m1 with a power-of-two scale per 32 values, ``moe_kernels.mxfp4``). Left
unset, a checkpoint whose config.json carries an FP8 ``quantization_config`` runs its own scheme, and so does
gpt-oss's MXFP4 one on CUDA with the Triton MoE backend (elsewhere its experts are dequantized at load: the
torch path would dequantize an expert per call); otherwise the experts stay in the model dtype. Only the routed
experts are quantized. A compressed-tensors INT4 checkpoint (Kimi-K2-Thinking, K2.5, K2.6:
``engine.loading.compressed_tensors``) runs its experts as stored, 4-bit ("int4", ``moe_kernels.int4``): it is
loaded packed, and no ``--quantization`` applies to it.
"""

import torch

from engine.core.config import QUANTIZATION_OPTIONS
from engine.loading import compressed_tensors, mxfp4
from engine.core.model_config import CheckpointError, ModelConfig
from moe_kernels.int4 import GROUP_SIZE as INT4_GROUP
from moe_kernels.quant import FP8_DTYPE, QuantScheme, dequantize

DEFAULT_BLOCK = (128, 128)  # the blocks of the published FP8 MoE checkpoints
# safetensors dtype names of the 8-bit weights a checkpoint may hold.
CHECKPOINT_8BIT = {"F8_E4M3": FP8_DTYPE, "I8": torch.int8}


def scheme_for_option(option: str) -> QuantScheme:
    if option not in QUANTIZATION_OPTIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATION_OPTIONS}, got {option!r}")
    if option == "fp8-block":
        return QuantScheme("fp8", DEFAULT_BLOCK)
    return QuantScheme(option)


def checkpoint_scheme(model_config: ModelConfig) -> QuantScheme | None:
    """The scheme a checkpoint's config.json ``quantization_config`` declares (None if it has none)."""
    qc = model_config.cfg("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    method = qc.get("quant_method")
    if method == "mxfp4":
        return None  # gpt-oss's MXFP4 experts: dequantized as read (``engine.loading.mxfp4``), stored as asked
    if method == compressed_tensors.QUANT_METHOD:
        compressed_tensors.check_config(qc)
        return QuantScheme("int4")  # the experts stay packed as stored (``engine.loading.model_loader``)
    if method != "fp8":
        raise CheckpointError(f"config.json quantization_config.quant_method {method!r} is not supported "
                              "(supported: 'fp8', with float8_e4m3fn weights and weight_scale or weight_scale_inv; "
                              "'mxfp4' for gpt-oss's experts; 'compressed-tensors' with INT4 experts)")
    block = qc.get("weight_block_size")
    if block is not None:
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise CheckpointError(f"config.json quantization_config.weight_block_size must be two positive "
                                  f"integers, got {block!r}")
        block = (block[0], block[1])
    return QuantScheme("fp8", block)


def resolve_scheme(option: str | None, model_config: ModelConfig, device: torch.device | None = None,
                   moe_backend: str = "auto", expert_split: int = 1) -> QuantScheme | None:
    """The experts' storage: ``option`` if set, else the checkpoint's own scheme, else None (model dtype). An INT4
    checkpoint's experts are always its own scheme (``option`` is refused: ValueError), split in whole groups.

    An MXFP4 checkpoint is dequantized into the model dtype unless ``--quantization mxfp4`` asks for 4 bits: the
    MXFP4 Triton kernel has not been measured on a GPU yet, and a quantized load holds the model's non-expert
    weights and one layer's experts in float32 on the host (``build_model``), where the dequantizing load holds
    one tensor at a time. (``device`` and ``moe_backend`` are kept for the day it is the default on CUDA.)
    """
    stored = None if mxfp4.declared(model_config) else checkpoint_scheme(model_config)
    if stored is not None and stored.method == "int4":
        if option is not None:
            raise ValueError(f"quantization {option!r}: this checkpoint's routed experts are INT4 (compressed-tensors) "
                             "and are served as stored; leave quantization unset")
        check_int4_split(model_config, expert_split)
        return stored
    return scheme_for_option(option) if option is not None else stored


def check_int4_split(model_config: ModelConfig, expert_split: int) -> None:
    """ValueError unless each rank's slice of an expert's intermediate size holds whole groups of 32 (INT4 scales
    are per 32 input channels of the down projection; ``expert_split``: tensor-parallel ranks cutting each expert)."""
    inter = model_config.cfg("moe_intermediate_size")
    if inter and (inter % expert_split or (inter // expert_split) % INT4_GROUP):
        raise ValueError(f"tensor_parallel_size {expert_split}: INT4 experts' intermediate size {inter} must split "
                         f"into slices of a multiple of {INT4_GROUP} (their scale groups); use "
                         "enable_expert_parallel or a smaller tensor_parallel_size")


def check_supported(scheme: QuantScheme | None, device: torch.device, dtype: torch.dtype, moe_backend: str) -> None:
    """ValueError naming ``quantization`` when this device, dtype or MoE backend cannot run ``scheme``."""
    if scheme is None:
        return
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"quantization needs a float32, bfloat16 or float16 model, got dtype {dtype}")
    if scheme.method == "fp8" and device.type == "cuda" and moe_backend == "triton":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if torch.cuda.get_device_capability(index) < (8, 9):
            raise ValueError(f"quantization fp8 needs a GPU of compute capability 8.9 or newer (float8_e4m3fn "
                             f"in Triton); {torch.cuda.get_device_name(index)} is "
                             f"{torch.cuda.get_device_capability(index)}: use quantization int8")
    if scheme.block is not None and moe_backend == "triton" and (scheme.block[1] % 16 or min(scheme.block) < 16):
        raise ValueError(f"quantization blocks {scheme.block}: the Triton kernels need blocks of 16 or more "
                         "with a block K that is a multiple of 16")


def quantize_experts_(model: torch.nn.Module, scheme: QuantScheme | None) -> None:
    """Store every MoE block's routed experts in ``scheme`` (nothing when None), layer by layer."""
    if scheme is None:
        return
    from engine.layers.moe import ExpertWeights

    for module in model.modules():
        if isinstance(module, ExpertWeights) and module.scheme is None:  # (the loader quantizes layers as read)
            module.quantize_(scheme)


def scale_name(name: str, keys) -> str | None:
    """The checkpoint name of the scale of 8-bit tensor ``name`` (``<name>_scale_inv`` as DeepSeek-V3 and
    Qwen3 FP8 checkpoints write it, or ``..weight_scale``), among ``keys``; None if there is none."""
    for candidate in (name + "_scale_inv", name + "_scale"):
        if candidate in keys:
            return candidate
    return None


def is_scale_name(name: str) -> bool:
    """A checkpoint tensor that scales another (consumed with it) or an activation scale (unused: weight-only)."""
    return name.endswith(("weight_scale_inv", "weight_scale", "input_scale"))


def dequantize_checkpoint_tensor(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                                 name: str, path: str) -> torch.Tensor:
    """An 8-bit checkpoint tensor q [N, K] (or [E, N, K]) times its scale -> float32: one scale for the tensor,
    one per output channel ([.., N] or [.., N, 1]), or one per ``block`` ([.., N/bn, K/bk])."""
    scale = scale.to(torch.float32)
    if scale.numel() == 1:
        return q.to(torch.float32) * scale.reshape(())
    lead, (n, k) = tuple(q.shape[:-2]), tuple(q.shape[-2:])
    if tuple(scale.shape) in ((*lead, n), (*lead, n, 1)):
        return dequantize(q, scale.reshape(*lead, n))
    if block is not None and tuple(scale.shape) == (*lead, -(-n // block[0]), -(-k // block[1])):
        return dequantize(q, scale, block)
    raise CheckpointError(f"{path}: scale of {name} has shape {tuple(scale.shape)}, which fits neither one per "
                          f"output channel of {tuple(q.shape)} nor blocks {block}")
