"""Running a linear-attention rule (the gated delta rule, Kimi's) over one step's requests, each from its own
state slot: the decodes together, one recurrent step each, then each prompt chunk in the chunked form. The rule
is the caller's; this file only knows the slots (``StateMetadata``) and the state cache's layout. ``kernel``
"triton" runs the Triton kernels instead (``engine.kernels.delta_rule``: the decodes in one launch, every prompt
chunk in another), which compute the same rules.

Legend: T flat rows, h heads, dk key dim, dv value dim, S state slots, D decode requests."""

from collections.abc import Callable

import torch

from engine.device_batch.state_metadata import StateMetadata

# (q, k, v, g, beta, state) -> (out float32, state after); ``state`` [h, dk, dv] or, recurrent, [D, h, dk, dv].
Rule = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def rule_over_requests(recurrent: Rule, chunked: Rule, rec_cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, states: StateMetadata,
                       kernel: str = "torch") -> torch.Tensor:
    """q, k [T, hk, dk] (value head j reads key head j // (h / hk)), v [T, h, dv], g and beta per token (their
    shapes are the rule's: g [T, h] per head or [T, h, dk] per key channel), ``rec_cache`` [S, h, dk, dv] updated
    in place -> out [T, h, dv] float32. A fresh request starts from a zero state."""
    if kernel == "triton":
        from engine.kernels.delta_rule import delta_rule_triton  # imported where it runs: TRITON_INTERPRET

        return delta_rule_triton(q, k, v, g, beta, rec_cache, states)
    r = v.shape[1] // q.shape[1]
    if r > 1:  # the torch rules take one key head per value head
        q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)  # [T, h, dk]
    out = torch.empty(*v.shape, dtype=torch.float32, device=q.device)  # [T, h, dv]
    d = states.num_decodes
    if d:
        slots = states.decode_slots
        past = rec_cache[slots].masked_fill(states.decode_fresh[:, None, None, None], 0.0)  # [D, h, dk, dv]
        out[:d], rec_cache[slots] = recurrent(q[:d], k[:d], v[:d], g[:d], beta[:d], past)
    for row, end, slot, fresh in states.prefills:
        past = rec_cache.new_zeros(rec_cache.shape[1:]) if fresh else rec_cache[slot]  # [h, dk, dv]
        out[row:end], rec_cache[slot] = chunked(q[row:end], k[row:end], v[row:end], g[row:end], beta[row:end], past)
    return out
