"""The one entry point for routed-expert compute, dispatching to a backend."""

import functools
import importlib.util
import os

import torch

from moe_kernels.activation import ExpertActivation
from moe_kernels.quant import check_scales
from moe_kernels.torch_backend import fused_moe_loop, fused_moe_torch

# "torch-loop" forces the per-expert loop under "torch" (the reference; benchmarks compare with it).
_BACKENDS = ("auto", "torch", "torch-loop", "triton")


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _interpret_requested() -> bool:
    # Parsed as Triton parses it (triton.knobs: "1", "true", "on").
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")


def available_backends() -> list[str]:
    """Backends that can run in this process ("triton" needs CUDA or TRITON_INTERPRET=1).

    Does not import the Triton backend: importing it freezes whether its kernels
    are compiled or interpreted, which a later TRITON_INTERPRET=1 could not undo.
    """
    names = ["torch"]
    if _triton_installed() and (torch.cuda.is_available() or _interpret_requested()):
        names.append("triton")
    return names


# Packed 4-bit weights: values per stored element along K (MXFP4 two a byte, INT4 eight an int32 word).
_VALUES_PER_ELEMENT = {torch.uint8: 2, torch.int32: 8}


def _check_shapes(x, w13, w2, topk_weights, topk_ids) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got {tuple(x.shape)}")
    num_experts, two_inter, hidden = w13.shape
    hidden *= _VALUES_PER_ELEMENT.get(w13.dtype, 1)  # packed 4-bit weights hold several values along H
    if hidden != x.shape[1] or two_inter % 2:
        raise ValueError(f"w13 must be [E, 2I, H] with H={x.shape[1]}, got {tuple(w13.shape)}")
    w2_inter = two_inter // 2 // _VALUES_PER_ELEMENT.get(w2.dtype, 1)
    if tuple(w2.shape) != (num_experts, hidden, w2_inter):
        raise ValueError(f"w2 must be [E, H, I]={num_experts, hidden, w2_inter}, got {tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be [T, k]"
        )


def _check_biases(w13, w2, w13_bias, w2_bias) -> None:
    num_experts, two_inter, hidden = w13.shape[0], w13.shape[1], w2.shape[1]
    expected = (("w13_bias", w13_bias, (num_experts, two_inter)), ("w2_bias", w2_bias, (num_experts, hidden)))
    for name, bias, shape in expected:
        if bias is not None and tuple(bias.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {list(bias.shape)}")


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    backend: str = "auto",
    activation: str | ExpertActivation = "silu",
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the routed experts of one MoE layer.

    Legend: T tokens, H hidden, I expert intermediate, E experts, k top-k.

    Args:
        x: [T, H] activations.
        w13: [E, 2I, H] gate rows then up rows of each expert.
        w2: [E, H, I] down projection of each expert.
        topk_weights: [T, k] routing weights (float32 from ``route``).
        topk_ids: [T, k] expert ids.
        backend: "auto" (Triton on CUDA, torch elsewhere), "torch" (grouped matmuls where
            ``torch._grouped_mm`` can run, the per-expert loop otherwise), "torch-loop" or "triton".
        activation: an ``ExpertActivation`` (``moe_kernels.activation``), or the name of one of its kinds
            with default constants: "silu" (SwiGLU experts), "gelu", "clamped_swiglu" (gpt-oss).
        w13_scale, w2_scale: float32 scales when w13 and w2 are 8-bit (float8_e4m3fn or int8, see
            ``moe_kernels.quant``): [E, 2I] and [E, H] per output channel, or with ``block_shape``
            (block_n, block_k) one per block, [E, 2*ceil(I/bn), ceil(H/bk)] (gate blocks, then up blocks)
            and [E, ceil(H/bn), ceil(I/bk)]. When w13 and w2 are uint8 they are MXFP4 (``moe_kernels.mxfp4``):
            packed w13 [E, 2I, H/2] and w2 [E, H, I/2] with uint8 e8m0 scales [E, 2I, H/32] and [E, H, I/32]. When
            they are int32 they are INT4 (``moe_kernels.int4``): packed w13 [E, 2I, H/8] and w2 [E, H, I/8] with
            bfloat16 (or float32) scales [E, 2I, H/32] and [E, H, I/32], one per group of 32 values.
        w13_bias, w2_bias: optional per-expert biases (gpt-oss), never quantized: [E, 2I] added to the gate/up
            projection before the activation (gate then up, as w13's rows) and [E, H] to the down projection,
            inside the routing weight.

    Returns:
        [T, H] in the dtype of ``x``: sum over k of weight * expert(x).
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    activation = ExpertActivation.of(activation)
    _check_shapes(x, w13, w2, topk_weights, topk_ids)
    _check_biases(w13, w2, w13_bias, w2_bias)
    check_scales(w13, w13_scale, block_shape, "w13", halves=2)
    check_scales(w2, w2_scale, block_shape, "w2")
    quant = dict(w13_scale=w13_scale, w2_scale=w2_scale, block_shape=block_shape, w13_bias=w13_bias, w2_bias=w2_bias)
    if backend == "auto":
        backend = "triton" if x.is_cuda and "triton" in available_backends() else "torch"
    if x.shape[0] == 0:
        return torch.empty_like(x)
    if backend == "triton":
        if "triton" not in available_backends():
            raise RuntimeError("backend='triton' needs triton and a CUDA device (or TRITON_INTERPRET=1 on the CPU)")
        from moe_kernels.triton_backend import fused_moe_triton

        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, activation=activation, **quant)
    if backend == "torch-loop":
        return fused_moe_loop(x, w13, w2, topk_weights, topk_ids, activation=activation, **quant)
    return fused_moe_torch(x, w13, w2, topk_weights, topk_ids, activation=activation, **quant)
