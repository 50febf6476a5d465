"""The torch backend: grouped matmuls where ``torch._grouped_mm`` can run, the per-expert loop otherwise.

Legend: T tokens, H hidden, I expert intermediate, E experts, k top-k, S = T*k slots.

The loop is also the readable reference the grouped path is tested against.
"""

import torch

from moe_kernels.activation import ExpertActivation, gated_activation
from moe_kernels.expert_sort import sort_slots_by_expert
from moe_kernels.grouped_backend import fused_moe_grouped, grouped_mm_supported
from moe_kernels.quant import dequantize

# On the CPU the grouped path allocates whole-batch [S, 2I] and [S, H] buffers; past about a MiB each call
# pays page faults for them (glibc gives large freed blocks back to the OS), while the loop's per-expert
# buffers stay small and are reused. Measured (benchmarks/moe_torch_cpu.py, float32, 1 thread): one layer
# 1.1-1.6x faster grouped up to T=64 (0.5 MiB), 0.45-1.14x from T=256 (2 MiB) on. End to end the
# difference was within the shared test machine's noise (docs/decisions/cpu-moe-path.md).
CPU_GROUPED_MAX_BYTES = 1 << 20


def _grouped_pays_off(x: torch.Tensor, w13: torch.Tensor, top_k: int) -> bool:
    if x.device.type != "cpu":
        return True
    widest = max(w13.shape[1], w13.shape[2])  # 2I or H: the widest [S, .] intermediate
    return x.shape[0] * top_k * widest * x.element_size() <= CPU_GROUPED_MAX_BYTES


def fused_moe_torch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str | ExpertActivation = "silu",
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts with torch ops: ``fused_moe_grouped`` where supported, else ``fused_moe_loop``.

    x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k], topk_ids [T, k] -> [T, H].
    The choice is a check of dtypes, device and strides on each call (see
    ``grouped_mm_supported``), never a caught error; on the CPU also of size
    (``CPU_GROUPED_MAX_BYTES``): prefill-sized calls keep the loop. Quantized weights (8-bit or 4-bit, with their scales,
    see ``moe_kernels.quant``) always take the loop.
    """
    if w13_scale is None and grouped_mm_supported(x, w13, w2) and _grouped_pays_off(x, w13, topk_ids.shape[1]):
        return fused_moe_grouped(x, w13, w2, topk_weights, topk_ids, activation=activation, w13_bias=w13_bias,
                                 w2_bias=w2_bias)
    return fused_moe_loop(x, w13, w2, topk_weights, topk_ids, activation=activation, w13_scale=w13_scale,
                          w2_scale=w2_scale, block_shape=block_shape, w13_bias=w13_bias, w2_bias=w2_bias)


def _int8pack_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    # torch 2.13's CPU kernel is fast only for bfloat16 activations: [1, 1024] x [1024, 1024], 1 thread, 26 us
    # against 70 us for the bfloat16 matmul (52 vs 73 us at 4 rows); for float32 and float16 it is a slow
    # fallback (700-780 us), slower than converting the weight (benchmarks/quantized_experts.py).
    # bfloat16 needs K a multiple of 16: other K gave garbage or crashed when probed.
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and w.shape[1] % 16 == 0


def expert_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None,
                  block_shape: tuple[int, int] | None, halves: int = 1) -> torch.Tensor:
    """x [n, K] @ w[N, K]^T -> [n, N] in x's dtype, for a float weight or an 8-bit one with its scale
    (``halves`` as ``moe_kernels.quant``: 2 for a packed gate/up weight).

    INT8 per channel with bfloat16 activations on the CPU is torch's weight-only int8 matmul (no dequantized
    copy of the weight); otherwise the 8-bit weight is converted to x's dtype for the matmul (a transient copy:
    8-bit storage saves memory, not time, there), per-channel scales applied to the output columns, block
    scales to the weight.
    """
    if scale is None:
        return x @ w.t()
    if w.dtype in (torch.uint8, torch.int32):  # MXFP4 or INT4: this expert dequantized for the call, one at a time
        return x @ dequantize(w, scale, None, x.dtype).t()
    if block_shape is not None:
        return x @ dequantize(w, scale, block_shape, x.dtype, halves).t()
    if w.dtype == torch.int8 and _int8pack_ok(x, w):
        return torch._weight_int8pack_mm(x.contiguous(), w, scale.to(x.dtype))
    return (x @ w.to(x.dtype).t()).mul_(scale.to(x.dtype))


def fused_moe_loop(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str | ExpertActivation = "silu",
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """One matmul pair per active expert; any dtype and layout, 8-bit weights too. Shapes as ``fused_moe_torch``."""
    num_tokens = topk_ids.shape[0]
    slots = sort_slots_by_expert(topk_ids, w13.shape[0])
    counts = slots.counts.tolist()  # the loop needs the group sizes on the host
    # Accumulate the k contributions in float32, or float64 for float64 inputs (the references).
    acc_dtype = torch.promote_types(x.dtype, torch.float32)
    slot_weights = topk_weights.reshape(-1).index_select(0, slots.order).to(acc_dtype)  # [S]
    out = torch.zeros(num_tokens, x.shape[1], dtype=acc_dtype, device=x.device)  # [T, H]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        tokens = slots.tokens[rows]  # [n]
        w13_s = None if w13_scale is None else w13_scale[expert]
        w2_s = None if w2_scale is None else w2_scale[expert]
        gate_up = expert_linear(x.index_select(0, tokens), w13[expert], w13_s, block_shape, halves=2)  # [n, 2I]
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[expert].to(gate_up.dtype)
        hidden = gated_activation(gate_up, activation)  # [n, I]
        expert_out = expert_linear(hidden, w2[expert], w2_s, block_shape).to(acc_dtype)  # [n, H]
        if w2_bias is not None:
            expert_out += w2_bias[expert].to(acc_dtype)
        # Weight and scatter in one pass.
        out.index_add_(0, tokens, expert_out.mul_(slot_weights[rows, None]))
        start += count
    return out.to(x.dtype)
