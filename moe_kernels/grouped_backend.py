"""The torch MoE path as grouped matmuls: one ``torch._grouped_mm`` per projection over slots sorted by expert.

Legend: T tokens, H hidden, I expert intermediate, E experts, k top-k, S = T*k slots.

On the CPU ``torch._grouped_mm`` runs one BLAS matmul per expert in C++, so
what this path saves against the per-expert Python loop is the loop itself:
one gather, two grouped matmuls, one activation and one combine per layer
instead of about six small ops per active expert, and no per-expert scatter.
"""

import functools

import torch

from moe_kernels.activation import ExpertActivation, gated_activation_
from moe_kernels.expert_sort import sort_slots_by_expert

# dtypes torch._grouped_mm accepts on the CPU (float64 is refused: the float64 references take the loop).
_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _cuda_has_grouped_mm(device_index: int) -> bool:
    # The CUDA kernel is CUTLASS for sm90 and newer; older GPUs take the loop rather than a slow fallback.
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def _operand_ok(mat: torch.Tensor, align: int, aligned_start: bool) -> bool:
    """The layout rule ``torch._grouped_mm`` enforces on each operand (ATen's check_valid_strides): one unit
    stride in the last two dims, the other a multiple of 16 bytes; on CUDA also a 16-byte aligned start
    (its TMA loads need it; the CPU op of torch 2.13 accepts any start, so the CPU check does not ask)."""
    if aligned_start and mat.data_ptr() % 16:
        return False
    rows, cols = mat.shape[-2:]
    row_stride, col_stride = mat.stride()[-2:]
    if row_stride == 1 and col_stride >= max(1, rows):
        return col_stride % align == 0
    if col_stride == 1 and row_stride >= max(1, cols):
        return row_stride % align == 0
    return False


def grouped_mm_runs_on(x: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` exists for x's device and dtype (float32/bfloat16/float16 on the CPU,
    bfloat16 on CUDA sm90+); the operands' layout rule is ``_operand_ok``'s, the caller's to meet."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":
        return x.dtype in _CPU_DTYPES
    if x.device.type == "cuda":
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        return x.dtype == torch.bfloat16 and _cuda_has_grouped_mm(index)
    return False


def grouped_mm_supported(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether ``fused_moe_grouped`` can run these operands; cheap enough to ask on every call.

    x [T, H], w13 [E, 2I, H], w2 [E, H, I]. Needs ``torch._grouped_mm``, one
    dtype for all three (float32/bfloat16/float16 on the CPU, bfloat16 on CUDA
    sm90+), H and I multiples of 16 bytes (the gathered x and the activation
    are row-major [S, H] and [S, I]) and weights laid out as the op requires.
    """
    if not (x.dtype == w13.dtype == w2.dtype) or not grouped_mm_runs_on(x):
        return False
    align = 16 // x.element_size()  # elements per 16 bytes
    hidden, inter = w2.shape[1], w2.shape[2]
    on_cuda = x.device.type == "cuda"
    return (hidden % align == 0 and inter % align == 0
            and _operand_ok(w13.transpose(-2, -1), align, on_cuda) and _operand_ok(w2.transpose(-2, -1), align, on_cuda))


def fused_moe_grouped(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str | ExpertActivation = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts as two grouped matmuls; only where ``grouped_mm_supported(x, w13, w2)``.

    x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k], topk_ids [T, k]
    -> [T, H] in the dtype of x: sum over k of weight * expert(x). T = 0 is allowed.
    Optional biases w13_bias [E, 2I], w2_bias [E, H] are gathered per sorted row.
    """
    num_tokens, top_k = topk_ids.shape
    slots = sort_slots_by_expert(topk_ids, w13.shape[0])
    # offs[e] = the end row of expert e's group in the sorted rows; empty experts repeat the previous end.
    offs = torch.cumsum(slots.counts, 0, dtype=torch.int32)  # [E]
    xs = x.index_select(0, slots.tokens)  # [S, H], rows in expert order
    gate_up = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs)  # [S, 2I]
    if w13_bias is not None or w2_bias is not None:
        row_experts = topk_ids.reshape(-1).to(torch.int64).index_select(0, slots.order)  # [S] expert of each row
    if w13_bias is not None:
        gate_up += w13_bias.to(gate_up.dtype).index_select(0, row_experts)
    # In place, so no [S, I] buffers: the op takes the [S, I] view (row stride 2I, a multiple of 16 bytes).
    hidden = gated_activation_(gate_up, activation)  # [S, I]
    ys = torch._grouped_mm(hidden, w2.transpose(-2, -1), offs=offs).to(torch.float32)  # [S, H]
    if w2_bias is not None:
        ys += w2_bias.to(torch.float32).index_select(0, row_experts)
    # Combine: weights multiplied in (float32), rows back to slot order, each token's k rows summed. The k
    # terms are added in routing order whatever the batch, with no atomics on any device (index_add_ has them
    # on CUDA); and it is one [S, H] buffer fewer than weighting the un-permuted [T, k, H] rows.
    ys.mul_(topk_weights.reshape(-1).index_select(0, slots.order).to(torch.float32).unsqueeze(1))
    y = torch.empty_like(ys).index_copy_(0, slots.order, ys)  # [S, H], slot s = token s // k, choice s % k
    return y.view(num_tokens, top_k, x.shape[1]).sum(dim=1).to(x.dtype)  # [T, H]
