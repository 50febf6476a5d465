"""Readable reference backend: sort token slots by expert, one matmul per active expert."""

import torch
import torch.nn.functional as F


def _activate(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    # gate_up: [n, 2I] with gate columns first, then up columns.
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(gate) * up
    raise ValueError(f"unsupported activation {activation!r}")


def fused_moe_torch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """Legend: T tokens, H hidden, I expert intermediate, E experts, k top-k.

    x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k], topk_ids [T, k] -> [T, H].
    """
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    flat_ids = topk_ids.reshape(-1).to(torch.int64)  # [T*k]
    # Stable sort keeps slots of one expert in token order, which makes the
    # per-expert matmuls deterministic regardless of batch composition.
    sorted_expert_ids, slot_order = torch.sort(flat_ids, stable=True)  # [T*k]
    token_of_slot = slot_order // top_k  # [T*k]
    counts = torch.bincount(sorted_expert_ids, minlength=num_experts).tolist()

    slot_weights = topk_weights.reshape(-1).index_select(0, slot_order).to(torch.float32)  # [T*k]
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)  # [T, H]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        tokens = token_of_slot[rows]  # [n]
        hidden = _activate(x.index_select(0, tokens) @ w13[expert].t(), activation)  # [n, I]
        expert_out = (hidden @ w2[expert].t()).float()  # [n, H]
        # Weight and scatter in one pass; float32 accumulation of the k contributions.
        out.index_add_(0, tokens, expert_out.mul_(slot_weights[rows, None]))
        start += count
    return out.to(x.dtype)
