"""How a MoE layer picks its experts, as one typed value (``RoutingSpec``): the families' routing kinds are
described in ``moe_kernels.routing``, which applies it."""

from dataclasses import dataclass
from typing import Literal

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
