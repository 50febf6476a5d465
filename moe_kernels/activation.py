"""The gated activation between an expert's gate/up and down projections.

``ExpertActivation`` names which one a model's experts use; every backend (the torch paths and the Triton
kernels) reads the same spec:

- ``silu``: SwiGLU, silu(gate) * up (Mixtral, Qwen, OLMoE).
- ``gelu``: exact (erf) gelu(gate) * up.
- ``clamped_swiglu``: gpt-oss's variant: the gate clamped from above at ``limit``, up clamped to
  [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate).
- ``clamped_silu``: Step-3.7-Flash's clamped SwiGLU: silu(gate) clamped from above at ``limit``, times up
  clamped to [-limit, limit] (the clamp follows the silu, as the checkpoints were trained).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

KINDS = ("silu", "gelu", "clamped_swiglu", "clamped_silu")


@dataclass(frozen=True, slots=True)
class ExpertActivation:
    """One expert activation: ``kind`` (see the module docstring) with gpt-oss's ``alpha`` and ``limit``
    (``alpha`` read only by ``clamped_swiglu``, ``limit`` by both clamped kinds)."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unsupported activation {self.kind!r}; one of {KINDS}")
        if self.kind.startswith("clamped") and not self.limit > 0:
            raise ValueError(f"{self.kind} needs a positive limit, got {self.limit}")

    @staticmethod
    def of(activation: "str | ExpertActivation") -> "ExpertActivation":
        """The spec for ``activation``: a spec as is, or a kind name with the default constants."""
        return activation if isinstance(activation, ExpertActivation) else ExpertActivation(activation)


SILU = ExpertActivation("silu")


def _clamped(gate: torch.Tensor, up: torch.Tensor, act: ExpertActivation) -> tuple[torch.Tensor, torch.Tensor]:
    gate = gate.clamp(max=act.limit)
    return gate * torch.sigmoid(gate * act.alpha), up.clamp(-act.limit, act.limit) + 1


def gated_activation(gate_up: torch.Tensor, activation: "str | ExpertActivation") -> torch.Tensor:
    """act(gate) * up for ``gate_up`` [n, 2I] holding gate columns first, then up columns -> [n, I] (a new tensor)."""
    act = ExpertActivation.of(activation)
    gate, up = gate_up.chunk(2, dim=-1)
    if act.kind == "silu":
        return F.silu(gate) * up
    if act.kind == "gelu":
        return F.gelu(gate) * up
    if act.kind == "clamped_silu":
        return F.silu(gate).clamp(max=act.limit) * up.clamp(-act.limit, act.limit)
    glu, up1 = _clamped(gate, up, act)
    return glu * up1


def gated_activation_(gate_up: torch.Tensor, activation: "str | ExpertActivation") -> torch.Tensor:
    """``gated_activation`` computed into the gate half of ``gate_up`` [n, 2I]; returns that half, a [n, I] view
    with row stride 2I. No new [n, I] buffers: at prefill sizes fresh multi-MB buffers cost page faults."""
    act = ExpertActivation.of(activation)
    gate, up = gate_up.chunk(2, dim=-1)
    if act.kind == "silu":
        return F.silu(gate, inplace=True).mul_(up)
    if act.kind == "gelu":
        return gate.copy_(F.gelu(gate)).mul_(up)  # F.gelu has no in-place form
    if act.kind == "clamped_silu":
        return F.silu(gate, inplace=True).clamp_(max=act.limit).mul_(up.clamp(-act.limit, act.limit))
    glu, up1 = _clamped(gate, up, act)  # two [n, I] temporaries: this variant is not on a hot CPU path
    return gate.copy_(glu).mul_(up1)
