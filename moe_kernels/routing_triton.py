"""Top-k routing in one Triton launch: scores, group limits, top-k, renormalization, scaling and expert counts.

Legend: T tokens, E experts, k top-k, G expert groups.

The torch ``route`` is five to seven launches (cast, softmax, topk's two
passes, sum, divide, cast) plus three for the expert-load counter, and a
grouped top-k adds as many again; at decode sizes each costs more than its
arithmetic. Here one program per token loads its E logits, scores them in
float32, adds the correction bias (if any) to get the choice scores, scores
each group and drops the experts of all but the best ``topk_group`` groups,
picks the k largest choice scores by repeated argmax (ties go to the lower
expert id), takes each pick's uncorrected score as its weight, renormalizes
and scales, writes weights and ids, and bumps the per-expert counters with
atomics (integer adds: exact in any order).

Groups need no reshape (E / G need not be a power of two): group g's score is
a masked reduction over the experts with ``expert // group_size == g``.

Set ``TRITON_INTERPRET=1`` before this module is first imported to run it on
the CPU (tests).
"""

import torch
import triton
import triton.language as tl

from moe_kernels.routing_spec import RoutingSpec

@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, counts_ptr,  # logits [T, E]; bias [E] f32; weights [T, k] f32;
    rows_ptr,                                               # ids [T, k] i32; counts [E] i64; rows [1] i64
    num_experts, stride_l, group_size, scaling_factor,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, TOP2_SUM: tl.constexpr,
    SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, SCALE: tl.constexpr,
    COUNT: tl.constexpr, COUNT_ROWS: tl.constexpr,
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
    choice = scores  # what picks the experts; the weights stay ``scores``
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + experts, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, -float("inf"))  # padding experts are never picked

    if N_GROUP > 1:  # keep only the experts of the TOPK_GROUP best groups
        group_of = experts // group_size
        gslots = tl.arange(0, BLOCK_G)
        gscores = tl.full((BLOCK_G,), -float("inf"), tl.float32)
        for g in tl.static_range(N_GROUP):
            vals = tl.where(valid & (group_of == g), choice, -float("inf"))
            first = tl.max(vals, axis=0)
            if TOP2_SUM:  # plus the second best: drop one (the lowest id) of the best and take the max again
                at = tl.min(tl.where(vals == first, experts, BLOCK_E), axis=0)
                first = first + tl.max(tl.where(experts == at, -float("inf"), vals), axis=0)
            gscores = tl.where(gslots == g, first, gscores)
        keep = experts < 0  # all False
        for i in tl.static_range(TOPK_GROUP):
            best_g = tl.max(gscores, axis=0)
            gi = tl.min(tl.where(gscores == best_g, gslots, BLOCK_G), axis=0)
            keep = keep | (group_of == gi)
            gscores = tl.where(gslots == gi, -float("inf"), gscores)
        choice = tl.where(keep, choice, -float("inf"))

    slots = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(choice, axis=0)
        idx = tl.min(tl.where(choice == best, experts, BLOCK_E), axis=0)  # lowest id among equal scores
        if HAS_BIAS:
            w = tl.sum(tl.where(experts == idx, scores, 0.0), axis=0)  # the pick's uncorrected score
        else:
            w = best
        top_w = tl.where(slots == i, w, top_w)
        top_i = tl.where(slots == i, idx, top_i)
        choice = tl.where(experts == idx, -float("inf"), choice)
    in_k = slots < TOP_K
    if RENORMALIZE:
        top_w = top_w / tl.sum(tl.where(in_k, top_w, 0.0), axis=0)
    if SCALE:
        top_w = top_w * scaling_factor
    tl.store(weights_ptr + t * TOP_K + slots, top_w, mask=in_k)
    tl.store(ids_ptr + t * TOP_K + slots, top_i, mask=in_k)
    if COUNT:
        counted = in_k
        if COUNT_ROWS:  # only the first rows[0] tokens are real: a padding row counts none of its picks
            counted = slots < tl.where(t < tl.load(rows_ptr), TOP_K, 0)
        tl.atomic_add(counts_ptr + top_i, tl.full((BLOCK_K,), 1, tl.int64), mask=counted)


INTERPRETED = not isinstance(_route_kernel, triton.runtime.JITFunction)


def route_triton(router_logits: torch.Tensor, spec: RoutingSpec, correction_bias: torch.Tensor | None = None,
                 expert_counts: torch.Tensor | None = None,
                 count_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``moe_kernels.route`` (arguments checked there); ``expert_counts`` [E] int64, if
    given, gets += 1 per pick of the first ``count_rows[0]`` tokens ([1] int64; None: of every token).

    Returns topk_weights [T, k] float32 and topk_ids [T, k] int32, by descending choice score.
    """
    if router_logits.is_cuda == INTERPRETED:
        raise RuntimeError("triton routing needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set before "
                           f"moe_kernels.routing_triton is first imported (logits on {router_logits.device})")
    num_tokens, num_experts = router_logits.shape
    top_k = spec.top_k
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)  # [T, k]
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)  # [T, k]
    if num_tokens == 0:
        return weights, ids
    if expert_counts is not None:
        assert expert_counts.dtype == torch.int64 and expert_counts.shape == (num_experts,)
    if count_rows is not None:
        assert count_rows.dtype == torch.int64 and count_rows.shape == (1,)
    if correction_bias is not None:
        correction_bias = correction_bias.float().contiguous()  # a no-op for the float32 buffer the layers keep
    n_group = spec.n_group if spec.grouped else 1
    _route_kernel[(num_tokens,)](
        router_logits, correction_bias if correction_bias is not None else weights, weights, ids,
        expert_counts if expert_counts is not None else ids,
        count_rows if count_rows is not None else ids,
        num_experts, router_logits.stride(0), num_experts // n_group, float(spec.scaling_factor),
        TOP_K=top_k, BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_K=max(2, triton.next_power_of_2(top_k)),
        N_GROUP=n_group, TOPK_GROUP=spec.topk_group, BLOCK_G=max(2, triton.next_power_of_2(n_group)),
        TOP2_SUM=spec.group_scoring == "top2_sum", SOFTMAX=spec.scoring == "softmax",
        HAS_BIAS=correction_bias is not None, RENORMALIZE=spec.renormalize, SCALE=spec.scaling_factor != 1.0,
        COUNT=expert_counts is not None, COUNT_ROWS=count_rows is not None, num_warps=1 if num_experts <= 64 else 2,
    )
    return weights, ids
