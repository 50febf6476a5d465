"""Routed-expert compute for MoE layers: top-k routing and grouped expert GEMMs.

Public entry points:
    route(router_logits, RoutingSpec(top_k, ...), correction_bias=None) -> (topk_weights, topk_ids)
        (plain top-k also as route(router_logits, top_k, renormalize, scoring="softmax"))
    fused_moe(x, w13, w2, topk_weights, topk_ids, backend="auto", activation="silu") -> out

This package never imports ``engine`` or anything above it.
"""

from moe_kernels.dispatch import fused_moe, available_backends
from moe_kernels.routing import RoutingSpec, route

__all__ = ["RoutingSpec", "route", "fused_moe", "available_backends"]
