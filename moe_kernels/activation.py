"""The gated activation between an expert's gate/up and down projections."""

import torch
import torch.nn.functional as F


def gated_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up for ``gate_up`` [n, 2I] holding gate columns first, then up columns -> [n, I] (a new tensor).

    ``activation`` is "silu" (SwiGLU experts) or "gelu".
    """
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(gate) * up
    raise ValueError(f"unsupported activation {activation!r}")


def gated_activation_(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``gated_activation`` computed into the gate half of ``gate_up`` [n, 2I]; returns that half, a [n, I] view
    with row stride 2I. No new [n, I] buffers: at prefill sizes fresh multi-MB buffers cost page faults."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate, inplace=True).mul_(up)
    if activation == "gelu":
        return gate.copy_(F.gelu(gate)).mul_(up)  # F.gelu has no in-place form
    raise ValueError(f"unsupported activation {activation!r}")
