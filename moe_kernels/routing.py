"""Top-k expert routing: which experts each token goes to, and with what weight.

Legend: T tokens, E experts, k top-k, G expert groups.

One typed description of a model's routing (``RoutingSpec``) covers the
families served:

- Mixtral, Qwen-MoE, OLMoE: softmax over all experts, top-k, optionally
  renormalised over the k chosen;
- Qwen2-MoE-style sigmoid scores;
- DeepSeek-V3 / GLM-4.5 / dots.llm1 / MiniMax-M2: sigmoid scores plus a learned
  per-expert correction bias that only *chooses* the experts (the weights are
  the uncorrected scores), optionally restricted to the best ``topk_group`` of
  ``n_group`` expert groups (a group scored by the sum of its two best
  corrected scores), renormalised, then scaled by ``scaling_factor``;
- DeepSeek-V2's ``group_limited_greedy``: softmax scores, groups scored by
  their best expert, no renormalisation, scaled.
"""

import torch

from moe_kernels.routing_spec import RoutingSpec, Scoring

def route(
    router_logits: torch.Tensor,
    spec: RoutingSpec | int,
    renormalize: bool = False,
    scoring: Scoring = "softmax",
    *,
    correction_bias: torch.Tensor | None = None,
    expert_counts: torch.Tensor | None = None,
    count_rows: torch.Tensor | None = None,
    backend: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick experts per token as ``spec`` says.

    Args:
        router_logits: [T, E] raw router scores, any float dtype (scored in float32).
        spec: a ``RoutingSpec``; or, for plain top-k, the top-k as an int with ``renormalize`` and
            ``scoring`` beside it (those two are ignored when ``spec`` is a RoutingSpec).
        correction_bias: optional [E] per-expert bias (``e_score_correction_bias``) added to the scores
            to choose the experts (and to score the groups); the weights stay the uncorrected scores.
        expert_counts: optional [E] int64 counter, incremented once per (token, chosen expert); updated on
            the device, never read here.
        count_rows: optional [1] int64: only the first ``count_rows[0]`` tokens are counted in
            ``expert_counts`` (the rest are padding rows of a fixed-size batch, e.g. a CUDA graph's); read on
            the device, so a captured graph counts each replay's real rows. None: every token is counted.
        backend: "torch", or "triton" (one fused launch; CUDA, or the CPU interpreter under
            TRITON_INTERPRET=1).

    Returns:
        topk_weights [T, k] float32 and topk_ids [T, k] int32, ordered by descending choice score (the
        corrected score; without a correction bias, the weight before scaling).
    """
    if not isinstance(spec, RoutingSpec):
        spec = RoutingSpec(top_k=spec, scoring=scoring, renormalize=renormalize)
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    spec.check(num_experts)
    if correction_bias is not None and tuple(correction_bias.shape) != (num_experts,):
        raise ValueError(f"correction_bias must be [{num_experts}], got shape {tuple(correction_bias.shape)}")

    if backend == "triton":
        from moe_kernels.routing_triton import route_triton

        return route_triton(router_logits, spec, correction_bias, expert_counts, count_rows)
    if backend != "torch":
        raise ValueError(f"backend must be 'torch' or 'triton', got {backend!r}")

    logits = router_logits.float()  # routing decisions in float32 whatever the model dtype
    scores = torch.softmax(logits, dim=-1) if spec.scoring == "softmax" else torch.sigmoid(logits)  # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.float()  # [T, E]
    if spec.grouped:
        choice = _keep_best_groups(choice, spec)
    top_choice, topk_ids = torch.topk(choice, spec.top_k, dim=-1)  # [T, k]
    topk_weights = top_choice if choice is scores else scores.gather(1, topk_ids)  # [T, k]
    if spec.renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if spec.scaling_factor != 1.0:
        topk_weights = topk_weights * spec.scaling_factor
    if expert_counts is not None:
        # index_add_, not bincount: bincount reads its size back to the host, a sync per layer on CUDA.
        flat = topk_ids.flatten()  # [T*k]
        if count_rows is None:
            ones = torch.ones_like(flat)
        else:  # a mask, not a slice: the number of real rows stays on the device
            real = torch.arange(topk_ids.shape[0], device=flat.device) < count_rows  # [T]
            ones = real[:, None].expand(topk_ids.shape).reshape(-1).to(flat.dtype)  # [T*k]
        expert_counts.index_add_(0, flat, ones)
    return topk_weights, topk_ids.to(torch.int32)


def _keep_best_groups(choice: torch.Tensor, spec: RoutingSpec) -> torch.Tensor:
    """choice [T, E] -> [T, E] with every expert outside its token's ``topk_group`` best groups at -inf."""
    num_tokens, num_experts = choice.shape
    grouped = choice.view(num_tokens, spec.n_group, num_experts // spec.n_group)  # [T, G, E/G]
    if spec.group_scoring == "top2_sum":
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    else:
        group_scores = grouped.amax(dim=-1)
    best = group_scores.topk(spec.topk_group, dim=-1).indices  # [T, topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # [T, G]
    return grouped.masked_fill(~keep[:, :, None], float("-inf")).view(num_tokens, num_experts)
