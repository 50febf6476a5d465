"""Routed-expert compute for MoE layers: top-k routing and grouped expert GEMMs.

Public entry points:
    route(router_logits, top_k, renormalize, scoring="softmax") -> (topk_weights, topk_ids)
    fused_moe(x, w13, w2, topk_weights, topk_ids, backend="auto", activation="silu") -> out

This package never imports ``engine`` or anything above it.
"""

from moe_kernels.dispatch import fused_moe, available_backends
from moe_kernels.routing import route

__all__ = ["route", "fused_moe", "available_backends"]
