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

from dataclasses import dataclass
from typing import Literal

import torch

Scoring = Literal["softmax", "sigmoid"]
GroupScoring = Literal["top2_sum", "max"]
_SCORINGS = ("softmax", "sigmoid")
_GROUP_SCORINGS = ("top2_sum", "max")


@dataclass(frozen=True, slots=True)
class RoutingSpec:
    """How a MoE layer picks its experts (static: the learned correction bias is passed to ``route`` apart).

    top_k: experts per token.
    scoring: "softmax" over all experts, or "sigmoid" per expert.
    renormalize: rescale the k chosen weights to sum to 1 (``norm_topk_prob``); otherwise they keep
        their share of the full distribution.
    n_group, topk_group: with n_group > 1, the E experts form n_group contiguous groups of E / n_group and
        only the experts of the topk_group best groups may be picked (DeepSeek's grouped top-k).
    group_scoring: a group's score, from the (corrected) scores of its experts: "top2_sum", the sum of
        its two best (DeepSeek-V3, GLM-4.5, dots.llm1), or "max", its best (DeepSeek-V2).
    scaling_factor: every weight is multiplied by it, after renormalisation (``routed_scaling_factor``).
    """

    top_k: int
    scoring: Scoring = "softmax"
    renormalize: bool = False
    n_group: int = 1
    topk_group: int = 1
    group_scoring: GroupScoring = "top2_sum"
    scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in _SCORINGS:
            raise ValueError(f"scoring must be one of {_SCORINGS}, got {self.scoring!r}")
        if self.group_scoring not in _GROUP_SCORINGS:
            raise ValueError(f"group_scoring must be one of {_GROUP_SCORINGS}, got {self.group_scoring!r}")
        if self.top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {self.top_k}")
        if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"need 1 <= topk_group <= n_group, got topk_group={self.topk_group}, n_group={self.n_group}")

    @property
    def grouped(self) -> bool:
        return self.n_group > 1 and self.topk_group < self.n_group

    def check(self, num_experts: int) -> None:
        """Raise ValueError unless this spec can route over ``num_experts`` experts."""
        if self.top_k > num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {self.top_k}")
        if self.n_group > 1:
            if num_experts % self.n_group:
                raise ValueError(f"{num_experts} experts do not split into n_group={self.n_group} equal groups")
            group_size = num_experts // self.n_group
            if self.group_scoring == "top2_sum" and group_size < 2:
                raise ValueError(f"top2_sum group scoring needs at least 2 experts per group, got {group_size}")
            if self.top_k > self.topk_group * group_size:
                raise ValueError(f"top_k={self.top_k} exceeds the {self.topk_group * group_size} experts of "
                                 f"topk_group={self.topk_group} groups")


def route(
    router_logits: torch.Tensor,
    spec: RoutingSpec | int,
    renormalize: bool = False,
    scoring: Scoring = "softmax",
    *,
    correction_bias: torch.Tensor | None = None,
    expert_counts: torch.Tensor | None = None,
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

        return route_triton(router_logits, spec, correction_bias, expert_counts)
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
        flat = topk_ids.flatten()
        expert_counts.index_add_(0, flat, torch.ones_like(flat))
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
