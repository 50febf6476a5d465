"""Top-k routing in one Triton launch: scores, top-k, renormalization and expert counts.

Legend: T tokens, E experts, k top-k.

The torch ``route`` is five to seven launches (cast, softmax, topk's two
passes, sum, divide, cast) plus three for the expert-load counter; at decode
sizes each costs more than its arithmetic. Here one program per token loads
its E logits, scores them in float32, picks the k largest by repeated argmax
(ties go to the lower expert id), renormalizes, writes weights and ids, and
bumps the per-expert counters with atomics (integer adds: exact in any order).

Set ``TRITON_INTERPRET=1`` before this module is first imported to run it on
the CPU (tests).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, counts_ptr,  # logits [T, E]; weights [T, k] f32; ids [T, k] i32; counts [E] i64
    num_experts, stride_l,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    SOFTMAX: tl.constexpr, RENORMALIZE: tl.constexpr, COUNT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    logits = tl.load(logits_ptr + t * stride_l + experts, mask=valid, other=-float("inf")).to(tl.float32)
    if SOFTMAX:
        e = tl.exp(logits - tl.max(logits, axis=0))
        scores = e / tl.sum(e, axis=0)
    else:
        scores = tl.sigmoid(logits)
    scores = tl.where(valid, scores, -1.0)  # scores are >= 0: padding experts are never picked

    slots = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(scores, axis=0)
        idx = tl.min(tl.where(scores == best, experts, BLOCK_E), axis=0)  # lowest id among equal scores
        top_w = tl.where(slots == i, best, top_w)
        top_i = tl.where(slots == i, idx, top_i)
        scores = tl.where(experts == idx, -2.0, scores)
    in_k = slots < TOP_K
    if RENORMALIZE:
        top_w = top_w / tl.sum(tl.where(in_k, top_w, 0.0), axis=0)
    tl.store(weights_ptr + t * TOP_K + slots, top_w, mask=in_k)
    tl.store(ids_ptr + t * TOP_K + slots, top_i, mask=in_k)
    if COUNT:
        tl.atomic_add(counts_ptr + top_i, tl.full((BLOCK_K,), 1, tl.int64), mask=in_k)


INTERPRETED = not isinstance(_route_kernel, triton.runtime.JITFunction)


def route_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax",
                 expert_counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``moe_kernels.route``; ``expert_counts`` [E] int64, if given, gets += 1 per pick.

    Returns topk_weights [T, k] float32 and topk_ids [T, k] int32, by descending weight.
    """
    if router_logits.is_cuda == INTERPRETED:
        raise RuntimeError("triton routing needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set before "
                           f"moe_kernels.routing_triton is first imported (logits on {router_logits.device})")
    num_tokens, num_experts = router_logits.shape
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)  # [T, k]
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)  # [T, k]
    if num_tokens == 0:
        return weights, ids
    if expert_counts is not None:
        assert expert_counts.dtype == torch.int64 and expert_counts.shape == (num_experts,)
    _route_kernel[(num_tokens,)](
        router_logits, weights, ids, expert_counts if expert_counts is not None else ids,
        num_experts, router_logits.stride(0),
        TOP_K=top_k, BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_K=max(2, triton.next_power_of_2(top_k)),
        SOFTMAX=scoring == "softmax", RENORMALIZE=renormalize, COUNT=expert_counts is not None,
        num_warps=1 if num_experts <= 64 else 2,
    )
    return weights, ids
