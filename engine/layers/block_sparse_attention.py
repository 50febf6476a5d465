"""MiniMax Sparse Attention (MiniMax-M3's sparse layers): GQA attention over the key blocks a block indexer keeps for
each query (``engine.layers.block_indexer``), over a paged cache of K, V and the indexer's keys.

Each token caches K and V (as ``Attention``) and one indexer key of ``d_i`` values per layer. Every query scores
the keys its causal mask shows, keeps its best blocks (its own among them) per indexer head, and each attention head
attends to the visible keys of its group's kept blocks (attention head j reads indexer head j * n_i // h).

Tensor parallel: the attention heads split over the ranks as ``Attention``'s (K and V of each rank's KV heads, or
one replicated KV head where there are fewer than ranks); the indexer is whole on every rank (its weights read
whole: the loader's default for tensors it does not split), every rank caches every token's indexer key and
computes every indexer head's selection, then its attention heads read the selections of their own groups. The
ranks agree without any exchange, as DeepSeek Sparse Attention's do (``engine.layers.sparse_mla_attention``): the
same operations on the same inputs (the hidden state is whole on every rank after each all-reduce, the cached
indexer keys are the same) give bitwise equal scores, so the same blocks are kept everywhere. Splitting the indexer
heads would save little (a few narrow projections and one matmul per query) and make the cache layout depend on
the split.

The torch path only (the runner falls back to it under the Triton backend): the selection is a boolean mask over
each query's context, so the attention reads the whole context and masks it, which is exact but does not save the
work a kernel reading only the kept blocks would.
"""

import torch
import torch.nn.functional as F

from engine.device_batch.attention_metadata import AttentionMetadata, DecodeGroup
from engine.layers.attention import Attention
from engine.layers.block_indexer import BlockIndexer
from engine.layers.cache_spec import CacheSpec
from engine.layers.paged_attention import chunk_visibility, decode_context, gather_visible


class BlockSparseAttention(Attention):
    """``Attention`` whose queries attend to the key blocks ``indexer`` keeps. Legend as ``Attention`` (h: this
    rank's query heads); n_i, d_i the indexer's heads and width (all of them on every rank), G decode requests of a
    group, L context."""

    backends = ("torch",)

    def __init__(self, *args, indexer: BlockIndexer, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.total_heads % indexer.num_heads:
            raise ValueError(f"index_n_heads ({indexer.num_heads}) must divide the attention heads "
                             f"({self.total_heads})")
        self.indexer = indexer
        # (K, V, indexer keys): [N_blocks + 1, block_size, kvh, d] twice, then [N_blocks + 1, block_size, d_i].
        self.kv_cache = (torch.empty(0), torch.empty(0), torch.empty(0))

    def cache_spec(self) -> CacheSpec:
        """K and V of this layer's KV heads, and its indexer key, per token."""
        kv = (self.num_kv_heads, self.head_dim)
        return CacheSpec((kv, kv, (self.indexer.head_dim,)))

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x [T, H] -> q [T, h, d], k and v [T, kvh, d] (as ``Attention``), the indexer's queries [T, n_i, d_i] and
        keys [T, d_i], and the tokens' positions [T]."""
        q, k, v = super().project(x, positions)
        cos = self.rotary.cos_cache[positions].to(x.dtype)[:, None, :]  # [T, 1, r]
        sin = self.rotary.sin_cache[positions].to(x.dtype)[:, None, :]
        return q, k, v, *self.indexer.project(x, cos, sin), positions

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor,
               index_k: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Writes k, v and the indexer keys at ``meta.slot_mapping``, returns [T, h, d]."""
        k_cache, v_cache, key_cache = self.kv_cache
        slots = meta.slot_mapping
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, v)
        key_cache.view(-1, self.indexer.head_dim).index_copy_(0, slots, index_k.to(key_cache.dtype))
        index_keys = key_cache.view(*key_cache.shape[:2], 1, self.indexer.head_dim)  # [N, bs, 1, d_i]
        out = torch.empty_like(q)
        for group in meta.decode_groups:
            span = slice(group.start, group.end)
            keys, values, ctx_keys, visible = self._decode_context(k_cache, v_cache, index_keys, group)
            out[span] = self._sparse(q[span, None], keys, values, index_q[span, None], ctx_keys,
                                     positions[span, None], visible[:, None])[:, 0]
        for (start, end), table, seq_len, mask in zip(
            meta.prefill_query_ranges, meta.prefill_block_tables, meta.prefill_seq_lens, meta.prefill_masks
        ):
            visible, seen = chunk_visibility(mask, start, end, seq_len, q.device)  # [q, L], [L]
            keys, values = gather_visible(k_cache, table, seen), gather_visible(v_cache, table, seen)  # [L, kvh, d]
            ctx_keys = gather_visible(index_keys, table, seen)[:, 0]  # [L, d_i]
            out[start:end] = self._sparse(q[None, start:end], keys[None], values[None], index_q[None, start:end],
                                          ctx_keys[None], positions[None, start:end], visible[None])[0]
        return out

    def _sparse(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, index_q: torch.Tensor,
                ctx_keys: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """q [B, n, h, d] over keys/values [B, L, kvh, d] under the indexer's selection (index_q [B, n, n_i, d_i],
        ctx_keys [B, L, d_i], positions [B, n], visible [B, n, L]) -> [B, n, h, d]."""
        kept = self.indexer.select(index_q, ctx_keys, positions, visible)  # [B, n_i, n, L]
        # Global head j reads indexer head j * n_i // h_total; this rank's heads are a run from rank * h.
        first = self.tp.rank * self.num_heads
        heads = torch.arange(first, first + self.num_heads, device=kept.device)  # [h]
        mask = kept.index_select(1, heads * self.indexer.num_heads // self.total_heads)  # [B, h, n, L]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=mask, scale=self.scale, enable_gqa=True)  # [B, h, n, d]
        return out.transpose(1, 2)

    def _decode_context(self, k_cache: torch.Tensor, v_cache: torch.Tensor, index_keys: torch.Tensor,
                        group: DecodeGroup):
        """Each request's whole context in position order: keys, values [G, L, kvh, d], indexer keys [G, L, d_i]
        and visibility [G, L] (a group's shared prefix blocks first, then its own)."""
        (keys, values, ctx_keys), visible = decode_context((k_cache, v_cache, index_keys), group)
        return keys, values, ctx_keys[:, :, 0], visible
