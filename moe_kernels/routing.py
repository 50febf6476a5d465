"""Top-k expert routing."""

import torch

_SCORINGS = ("softmax", "sigmoid")


def route(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
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

    logits = router_logits.float()  # routing decisions in float32 whatever the model dtype
    probs = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)  # [T, E]
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids.to(torch.int32)
