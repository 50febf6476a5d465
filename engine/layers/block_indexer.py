"""MiniMax Sparse Attention's block indexer (MiniMax-M3): which blocks of earlier keys each query attends to.

The indexer has its own small projections: per token ``n_i`` query heads of ``d_i`` (one per KV head group of the
attention) and one ``d_i`` wide key, each RMS-normed per head (zero-centred weights: loaded as 1 + weight) and
rotated as the attention's queries and keys are, over at most their first ``d_i`` dims (the attention's cos/sin cut
to ``d_i``, as the reference cuts them). The key is cached per token beside K and V. A query's score for a key is
the plain dot product (float32) of that head's query and the key; a block of ``block_size`` keys (blocks counted
from position 0) scores its best visible key. Each query keeps, per indexer head, the ``topk_blocks`` best blocks,
the ``local_blocks`` blocks ending at its own (its own block first) always among them (scored +inf), and attends to
the visible keys of the kept blocks only.
"""

import torch
from torch import nn

from engine.layers.norms import RMSNorm


def rotate_prefix(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of x [..., D]'s first ``min(r, D)`` dims by cos/sin [..., r] cut to that width (the rest
    pass through)."""
    width = min(cos.shape[-1], x.shape[-1])
    cos, sin, head, tail = cos[..., :width], sin[..., :width], x[..., :width], x[..., width:]
    half = width // 2
    rotated = torch.cat([-head[..., half:], head[..., :half]], dim=-1)
    return torch.cat([head * cos + rotated * sin, tail], dim=-1)


class BlockIndexer(nn.Module):
    """Legend: T tokens, H hidden, n_i indexer heads, d_i their width, B rows of a batch, n queries, L keys,
    nb = ceil(L / block_size) key blocks.

    Checkpoint names (``self_attn.index_*`` as published): ``index_q_proj`` [n_i * d_i, H], ``index_k_proj`` [d_i, H],
    ``index_q_norm`` and ``index_k_norm`` [d_i].
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, block_size: int, topk_blocks: int,
                 local_blocks: int, eps: float) -> None:
        super().__init__()
        if not 0 <= local_blocks <= topk_blocks:
            raise ValueError(f"index_local_blocks ({local_blocks}) must be between 0 and index_topk_blocks "
                             f"({topk_blocks}): the local blocks are always kept")
        self.num_heads, self.head_dim = num_heads, head_dim
        self.block_size, self.topk_blocks, self.local_blocks = block_size, topk_blocks, local_blocks
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H], cos/sin [T, 1, r] (the attention's rope) -> queries [T, n_i, d_i], keys [T, d_i]."""
        num_tokens = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x))[:, None, :]  # [T, 1, d_i]
        return rotate_prefix(q, cos, sin), rotate_prefix(k, cos, sin)[:, 0]

    def select(self, q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
               visible: torch.Tensor) -> torch.Tensor:
        """q [B, n, n_i, d_i], keys [B, L, d_i] (position j at index j), positions [B, n] (each query's),
        visible [B, n, L] bool (the causal mask) -> [B, n_i, n, L] bool: the visible keys of each query's kept
        blocks, per indexer head."""
        batch, n, _ = visible.shape
        length, bs = keys.shape[1], self.block_size
        scores = torch.einsum("bnhd,bld->bhnl", q.float(), keys.float())  # [B, n_i, n, L]
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        blocks = -(-length // bs)  # nb
        padded = torch.full((batch, self.num_heads, n, blocks * bs), float("-inf"), device=q.device)
        padded[..., :length] = scores
        block_scores = padded.view(batch, self.num_heads, n, blocks, bs).amax(dim=-1)  # [B, n_i, n, nb]
        own = positions // bs  # [B, n]
        for back in range(self.local_blocks):  # the query's own block and the ones before it: always kept
            local = (own - back).clamp(min=0)[:, None, :, None].expand(-1, self.num_heads, -1, 1)
            block_scores.scatter_(-1, local, float("inf"))
        top, index = block_scores.topk(min(self.topk_blocks, blocks), dim=-1)  # [B, n_i, n, k]
        # A slot on a block with no visible key (past the query) scores -inf: it selects nothing.
        index = index.masked_fill(top == float("-inf"), blocks)
        kept = torch.zeros(batch, self.num_heads, n, blocks + 1, dtype=torch.bool, device=q.device)
        kept.scatter_(-1, index, True)
        keys_kept = kept[..., :blocks].repeat_interleave(bs, dim=-1)[..., :length]  # [B, n_i, n, L]
        return keys_kept & visible[:, None]
