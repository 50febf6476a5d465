"""DeepSeek Sparse Attention's lightning indexer: which earlier tokens each query token attends to.

The indexer has its own small projections: per query token ``n_i`` heads of ``d_i`` wide queries (from the MLA
query latent) and a weight per head (from the hidden state); per token one ``d_i`` wide key (from the hidden
state, LayerNorm'd), which is cached in the paged cache beside the MLA latent. The first ``rope_dim`` dimensions
of the queries and the key are rotated (half-split RoPE for DeepSeek-V3.2, interleaved pairs for GLM-5); the
rest pass through. A query's score for a key is ``sum_h w_h * relu(scale * q_h . k)`` with ``scale = d_i ** -0.5``
and ``w_h`` the head weight times ``n_i ** -0.5``; the query then attends to the ``index_topk`` visible keys with
the highest scores (to every visible key while it sees no more than that), the earlier key first among equal
scores (``best_first``).

Scores are computed in float32, as the reference computes them. Under tensor parallelism the indexer is whole on
every rank, which selects the same keys as every other (``engine.layers.sparse_mla_attention`` says why).
"""

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.mla_attention import rotate

SCORE_BUDGET = 1 << 26  # float32 per-head scores one slice of queries may hold (256 MiB)
INDEX_NORM_EPS = 1e-6  # the key's LayerNorm (the reference's default; no config field)


def best_first(scores: torch.Tensor) -> torch.Tensor:
    """Indices of scores [..., L] from the highest, equal scores in key order.

    Ties are common: a key that every head with a positive weight scores below zero scores exactly 0, and where no
    key scores above 0 many tie for the last places. Taking the earlier key keeps a query's choice independent of
    how its batch was padded or chunked (``torch.topk`` breaks ties by where they fall in its row).
    """
    return scores.sort(dim=-1, descending=True, stable=True).indices


class LightningIndexer(nn.Module):
    """Legend: T tokens, H hidden, Q ``q_lora_rank``, n_i ``index_n_heads``, d_i ``index_head_dim``,
    p ``rope_dim`` (the rotated part), L keys.

    Checkpoint names (``self_attn.indexer.*``): ``wq_b`` [n_i * d_i, Q], ``wk`` [d_i, H], ``k_norm`` (a LayerNorm
    with weight and bias), ``weights_proj`` [n_i, H] (kept in float32 by the reference: computed in float32 here).
    """

    def __init__(self, hidden_size: int, q_lora_rank: int, num_heads: int, head_dim: int, rope_dim: int,
                 index_topk: int, rope_interleave: bool) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.rope_dim, self.index_topk = num_heads, head_dim, rope_dim, index_topk
        self.rope_interleave = rope_interleave
        self.scale = head_dim ** -0.5
        self.wq_b = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=INDEX_NORM_EPS)
        self.weights_proj = nn.Linear(hidden_size, num_heads, bias=False)

    def project(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H], q_resid [T, Q], cos/sin [T, 1, p] -> queries [T, n_i, d_i], key [T, d_i] (both with their
        first p dims rotated), head weights [T, n_i] float32 (``n_i ** -0.5`` folded in)."""
        num_tokens = x.shape[0]
        q = self.wq_b(q_resid).view(num_tokens, self.num_heads, self.head_dim)  # [T, n_i, d_i]
        k = self.k_norm(self.wk(x))[:, None, :]  # [T, 1, d_i]
        p = self.rope_dim
        q = torch.cat([rotate(q[..., :p], cos, sin, self.rope_interleave), q[..., p:]], dim=-1)
        k = torch.cat([rotate(k[..., :p], cos, sin, self.rope_interleave), k[..., p:]], dim=-1)[:, 0]
        weights = F.linear(x.float(), self.weights_proj.weight.float()) * self.num_heads ** -0.5  # [T, n_i]
        return q, k, weights

    def select(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Which keys each query attends to.

        q [B, n, n_i, d_i], weights [B, n, n_i], keys [B, L, d_i], visible [B, n, L] bool (the causal mask, padding
        hidden) -> [B, n, L] bool: the ``index_topk`` visible keys of highest score per query (all visible keys
        when a query sees no more than that).
        """
        batch, n, _ = visible.shape
        # The per-head scores [B, rows, n_i, L] of a long context are large: queries go in slices that bound them.
        rows = max(1, SCORE_BUDGET // max(batch * self.num_heads * keys.shape[1], 1))
        chosen = torch.zeros_like(visible)
        for lo in range(0, n, rows):
            part = slice(lo, lo + rows)
            scores = torch.matmul(q[:, part].float(), keys.float().transpose(-1, -2)[:, None])  # [B, r, n_i, L]
            # In place: the per-head scores are the largest tensor of a long prefill's indexer, and each pass over
            # them that allocates costs as much again (the same operations in the same order: the same bits).
            scores = scores.mul_(self.scale).relu_()
            scores = torch.matmul(weights[:, part, None, :], scores)[:, :, 0]  # [B, r, L]
            scores.masked_fill_(~visible[:, part], float("-inf"))
            top = best_first(scores)[..., :self.index_topk]  # [B, r, k]
            chosen[:, part].scatter_(-1, top, True)
        # Where a query sees fewer than k keys, the top k include hidden ones (score -inf): dropped again here.
        return chosen & visible
