"""Top-k expert routing."""

import torch

_SCORINGS = ("softmax", "sigmoid")


def route(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
    *,
    expert_counts: torch.Tensor | None = None,
    backend: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick ``top_k`` experts per token.

    Legend: T tokens, E experts, k top-k.

    Args:
        router_logits: [T, E] raw router scores, any float dtype.
        top_k: experts per token, 1 <= top_k <= E.
        renormalize: rescale the k chosen weights to sum to 1 (Mixtral,
            Qwen3-MoE with ``norm_topk_prob``); otherwise they keep their
            share of the full distribution (Qwen2-MoE, OLMoE defaults).
        scoring: "softmax" over all experts, or "sigmoid" per expert.
        expert_counts: optional [E] int64 counter, incremented once per
            (token, chosen expert); updated on the device, never read here.
        backend: "torch", or "triton" (one fused launch; CUDA, or the CPU
            interpreter under TRITON_INTERPRET=1).

    Returns:
        topk_weights [T, k] float32 and topk_ids [T, k] int32, ordered by
        descending weight.
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if scoring not in _SCORINGS:
        raise ValueError(f"scoring must be one of {_SCORINGS}, got {scoring!r}")

    if backend == "triton":
        from moe_kernels.routing_triton import route_triton

        return route_triton(router_logits, top_k, renormalize, scoring, expert_counts)
    if backend != "torch":
        raise ValueError(f"backend must be 'torch' or 'triton', got {backend!r}")

    logits = router_logits.float()  # routing decisions in float32 whatever the model dtype
    probs = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)  # [T, E]
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if expert_counts is not None:
        # index_add_, not bincount: bincount reads its size back to the host, a sync per layer on CUDA.
        flat = topk_ids.flatten()
        expert_counts.index_add_(0, flat, torch.ones_like(flat))
    return topk_weights, topk_ids.to(torch.int32)
