"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): multi-head latent attention over the tokens a lightning
indexer selects for each query, over a paged cache of latents and indexer keys.

Each token caches two rows per layer: its MLA latent row (``kv_lora_rank + qk_rope_head_dim``, as
``mla_attention``) and its indexer key (``index_head_dim``, a cache tensor of its own in ``index_key_dtype``, the
model's by default; a GLM-5 layer without an indexer caches no key). Every
query scores the keys its causal mask shows, keeps the ``index_topk`` best (``lightning_indexer``) and attends to
those only, reading only the selected latent rows, in the absorbed form (queries in latent space), prefill and decode
alike (a prefill chunk no longer than top-k selects every visible token: it runs as dense MLA's expanded prefill).

Tensor parallel: MLA's heads split over the ranks as ``MLAttention``'s (every rank caches the same latents); the
indexer is replicated, its weights whole on every rank (``tp_slices`` names only MLA's own tensors), and every rank
caches the same indexer keys and computes the same selection. Splitting its heads instead would need the per-head
scores summed over the ranks before the top-k: an all-reduce of [queries, context] float32 scores per indexed layer,
which costs more than the small indexer's duplicated work (a few narrow projections and one matmul per query
against the keys). The ranks agree without any exchange: they run the same operations on the same inputs (the
hidden state is whole on every rank after each all-reduce; the cached keys are the same), so their scores are
bitwise equal, and ``best_first`` breaks equal scores by key order, not by where a sort happens to leave them.

GLM-5's "shared" layers have no indexer: they attend to the tokens the last layer with one selected, in the same
forward. The selections pass between layers through a ``SelectionRelay`` that the model's layers share.

The torch path (the runner falls back to it under the Triton backend): a query's indexer scores every key of its
context (few heads, small keys), then its attention reads only the selected latent rows, gathered through the
block table (``engine.layers.selected_rows``): its cost follows ``index_topk``, not the context length. A decode
group gathers one row list per request; a prefill chunk one per query token (each selects its own tokens), in
slices of queries whose gathered rows and scores stay under ``SLICE_BUDGET``. Where a chunk's whole context is no
longer than ``index_topk`` every query selects all it sees, and the chunk runs as dense MLA's expanded prefill (per
query, the expanded form costs less than the absorbed one). ``decode_kernel = "triton"`` / ``prefill_kernel =
"triton"`` send decodes / prefill queries to a Triton kernel that reads the selected rows the same way
(``engine.kernels.sparse_mla``; a prefill query is one of its rows, with its request's block table), checked in
Triton's interpreter and compiled on an H200; off by default. On CUDA prefill chunks run as dense MLA's expanded
prefill with the selection as a mask by default (``prefill_kernel``): at 16k context flash attention over the whole
context beat both gathered forms there.

``fp8_cache`` (``--kv-cache-dtype fp8``): both rows are cached in DeepSeek-V3.2's FP8 layout
(``engine.layers.fp8_cache``: 656 + 132 bytes a token at the published shapes, against 1,408 in bf16), quantized
as they are written and dequantized where they are read: the selected latent rows of a query (a short chunk's
whole context), the keys the indexer scores. The Triton decode kernel does not read that layout yet.
"""

import torch
import torch.nn.functional as F

from engine.device_batch.attention_metadata import AttentionMetadata, DecodeGroup
from engine.layers import fp8_cache
from engine.layers.cache_spec import CacheSpec
from engine.layers.lightning_indexer import LightningIndexer
from engine.layers.mla_attention import MLAttention
from engine.layers.paged_attention import chunk_visibility, decode_context, gather_visible
from engine.layers.selected_rows import context_table, gather_selected_rows, selected_positions

# Values one slice of a prefill chunk's queries may hold at once: its gathered latent rows [s, K, r + p], scores
# and probabilities [s, h, K], position scratch [s, L]. 1 << 24 is 64 MiB in float32: 9 queries a slice at top-2,048
# over 16k tokens with V3's 128 heads at one rank. Under the Triton kernel, which gathers nothing: the slice's
# absorbed queries [s, h, r + p] and latent outputs [s, h, r].
SLICE_BUDGET = 1 << 24


class SelectionRelay:
    """The selections of the last layer that ran an indexer in this forward, in batch order (decode groups,
    then prefill chunks): what a layer without an indexer attends with."""

    def __init__(self) -> None:
        self.selections: list[torch.Tensor] = []
        self.index_topk = 0  # the most tokens a selection keeps per query (that layer's indexer's top-k)


class SparseMLAttention(MLAttention):
    """``MLAttention`` whose queries attend to the tokens ``indexer`` selects (``indexer`` None: the tokens the
    last indexed layer selected, read from ``relay``). Legend as ``MLAttention``; n_i, d_i the indexer's heads and
    width, G decode requests of a group, L context."""

    backends = ("torch",)

    def __init__(self, *args, indexer: LightningIndexer | None, relay: SelectionRelay,
                 index_head_dim: int, index_key_dtype: torch.dtype | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.q_lora_rank is None:
            raise ValueError("sparse attention's indexer reads the query latent: q_lora_rank must be set")
        self.indexer, self.relay = indexer, relay
        self.index_head_dim, self.index_key_dtype = index_head_dim, index_key_dtype
        # "torch", or "triton": decodes read only their selected rows in the Triton kernel
        # (``engine.kernels.sparse_mla``; checked in the interpreter, not yet the default).
        self.decode_kernel = "torch"
        # Prefill chunks: "torch" (each query gathers its selected rows), "triton" (each query a row of that kernel,
        # with its own positions and its request's table), "masked" (dense MLA's expanded prefill over the whole
        # context with the selection as a mask), or None: "masked" on CUDA, where flash attention over the context
        # measured 5.5x faster than the gathered form at 16k on an H200 (2026-11-29), "torch" elsewhere.
        self.prefill_kernel: str | None = None
        # Cache both rows in the FP8 layout (``engine.layers.fp8_cache``); set before the caches are allocated.
        self.fp8_cache = False
        # [N_blocks + 1, block_size, r + p] latent rows, then (with an indexer) [N_blocks + 1, block_size, d_i]
        # indexer keys; bound by the runner.
        self.kv_cache = (torch.empty(0), torch.empty(0))

    def cache_spec(self) -> CacheSpec:
        """The latent row of every token, and its indexer key where this layer has an indexer (byte rows in the FP8
        layout with ``fp8_cache``)."""
        if self.fp8_cache:
            rows = ((fp8_cache.latent_row_bytes(self.kv_lora_rank, self.rope_dim),),)
            if self.indexer is not None:
                rows += ((fp8_cache.key_row_bytes(self.index_head_dim),),)
            return CacheSpec(rows, dtype=torch.uint8)
        if self.indexer is None:
            return CacheSpec(((self.kv_lora_rank + self.rope_dim,),))
        return CacheSpec(((self.kv_lora_rank + self.rope_dim,), (self.index_head_dim,)),
                         entry_dtypes=(None, self.index_key_dtype))

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x [T, H] -> q [T, h, n + p], latent [T, r], k_pe [T, p] (as ``MLAttention.project``), then the indexer's
        queries [T, n_i, d_i], key [T, d_i] and head weights [T, n_i] (None, None, None without an indexer)."""
        q_resid = self.q_a_layernorm(self.q_a_proj(x))  # [T, q_lora_rank]
        q, latent, k_pe = self.project_from(x, q_resid, positions)
        if self.indexer is None:
            return q, latent, k_pe, None, None, None
        cos = self.rotary.cos_cache[positions].to(x.dtype)[:, None, :]  # [T, 1, p]
        sin = self.rotary.sin_cache[positions].to(x.dtype)[:, None, :]
        return q, latent, k_pe, *self.indexer.project(x, q_resid, cos, sin)

    def attend(self, q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, index_q: torch.Tensor | None,
               index_k: torch.Tensor | None, index_w: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        """Writes [latent, k_pe] and the indexer key at ``meta.slot_mapping``, returns [T, h, v]."""
        cache = self.kv_cache[0]
        width = cache.shape[-1]  # r + p values, or the FP8 row's bytes
        new_rows = fp8_cache.pack_latent_rows(latent, k_pe) if self.fp8_cache else torch.cat([latent, k_pe], dim=-1)
        cache.view(-1, width).index_copy_(0, meta.slot_mapping, new_rows)
        rows = cache.view(*cache.shape[:2], 1, width)  # [N, bs, 1, r + p (or bytes)]
        keys = None
        if self.indexer is not None:
            key_cache = self.kv_cache[1]
            key_width = key_cache.shape[-1]
            new_keys = fp8_cache.pack_key_rows(index_k) if self.fp8_cache else index_k.to(key_cache.dtype)
            key_cache.view(-1, key_width).index_copy_(0, meta.slot_mapping, new_keys)
            keys = key_cache.view(*key_cache.shape[:2], 1, key_width)  # [N, bs, 1, d_i (or bytes)]
        out = q.new_empty(q.shape[0], self.num_heads, self.v_dim)
        chosen: list[torch.Tensor] = []
        for group in meta.decode_groups:
            span = slice(group.start, group.end)
            select = self._decode_select(len(chosen), keys, index_q, index_w, span, group)  # [G, 1, L]
            chosen.append(select)
            positions = selected_positions(select[:, 0], self._index_topk())  # [G, K]
            if self.decode_kernel == "triton" and not self.fp8_cache:
                out[span] = self._sparse_triton(q[span], cache, context_table(group), positions)
            else:
                selected, valid = gather_selected_rows(cache, context_table(group), positions)  # [G, K, *], [G, K]
                out[span] = self._sparse_absorbed(q[span], self._latent_values(selected, q.dtype), valid)
        for (start, end), table, seq_len, mask in zip(
            meta.prefill_query_ranges, meta.prefill_block_tables, meta.prefill_seq_lens, meta.prefill_masks
        ):
            visible, seen = chunk_visibility(mask, start, end, seq_len, q.device)  # [q, L], [L]
            ctx_keys = None if keys is None else self._key_values(gather_visible(keys, table, seen)[:, 0])  # [L, d_i]
            select = self._select(len(chosen), index_q, index_w, slice(start, end),
                                  None if ctx_keys is None else ctx_keys[None], visible[None])[0]  # [q, L]
            chosen.append(select[None])
            kernel = self.prefill_kernel or ("masked" if q.is_cuda else "torch")
            if seq_len <= self._index_topk() or kernel == "masked":  # all it sees selected, or masked by choice
                ctx = self._latent_values(gather_visible(rows, table, seen)[:, 0], q.dtype)  # [L, r + p]; hidden 0
                out[start:end] = self._prefill_dense(q[start:end], ctx, select)
            else:
                out[start:end] = self._prefill_selected(q[start:end], cache, table, select)
        if self.indexer is not None:
            self.relay.selections, self.relay.index_topk = chosen, self.indexer.index_topk
        return out

    def _index_topk(self) -> int:
        """The most tokens this layer's selections keep per query (its indexer's, or the last indexed layer's)."""
        return self.relay.index_topk if self.indexer is None else self.indexer.index_topk

    def _latent_values(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Cached latent rows [..., r + p] as they are (or FP8 byte rows dequantized into ``dtype``)."""
        return fp8_cache.unpack_latent_rows(rows, self.kv_lora_rank, dtype) if self.fp8_cache else rows

    def _key_values(self, rows: torch.Tensor) -> torch.Tensor:
        """Cached indexer keys [..., d_i] as they are (or FP8 byte rows dequantized into float32)."""
        return fp8_cache.unpack_key_rows(rows, self.index_head_dim) if self.fp8_cache else rows

    def _decode_select(self, index: int, keys: torch.Tensor | None, index_q: torch.Tensor | None,
                       index_w: torch.Tensor | None, span: slice, group: DecodeGroup) -> torch.Tensor:
        """The decode group's selection [G, 1, L]: its indexer over every key of each request's context (the
        only whole-context read of a decode), or the last indexed layer's."""
        if self.indexer is None:
            return self.relay.selections[index]
        (ctx_keys,), visible = decode_context((keys,), group)  # [G, L, 1, d_i], [G, L]
        return self._select(index, index_q, index_w, span, self._key_values(ctx_keys[:, :, 0]), visible[:, None])

    def _select(self, index: int, index_q: torch.Tensor | None, index_w: torch.Tensor | None, span: slice,
                ctx_keys: torch.Tensor | None, visible: torch.Tensor) -> torch.Tensor:
        """The ``index``-th selection of this forward: this layer's indexer over ctx_keys [B, L, d_i] for the queries
        ``span`` (visible [B, n, L]) -> [B, n, L] bool, or the last indexed layer's where this one has none."""
        if self.indexer is None:
            return self.relay.selections[index]
        q, w = index_q[span], index_w[span]  # [B*n, n_i, d_i], [B*n, n_i]
        batch, n = visible.shape[:2]
        return self.indexer.select(q.view(batch, n, *q.shape[1:]), w.view(batch, n, -1), ctx_keys, visible)

    def _sparse_absorbed(self, q: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Absorbed: each query q [G, h, n + p] (a decode request, or one prefill token) over its own selected
        latent rows [G, K, r + p] (valid [G, K]: False on padding, whose rows are zero) -> [G, h, v]."""
        w_uk, w_uv = self._w_kv()
        r = self.kv_lora_rank
        q_latent = torch.einsum("ghn,hnr->ghr", q[..., :self.nope_dim], w_uk)
        qa = torch.cat([q_latent, q[..., self.nope_dim:]], dim=-1)  # [G, h, r + p]
        # Two matmuls rather than scaled_dot_product_attention: its math path (the only one for r + p = 576 wide
        # heads) scales and copies the gathered rows, the largest tensor here, on every call.
        scores = torch.matmul(qa, rows.transpose(1, 2)).mul_(self.scale)  # [G, h, K]
        scores.masked_fill_(~valid[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(rows.dtype)
        out = torch.matmul(probs, rows[..., :r])  # [G, h, r]; padded rows are zero: 0 x NaN cannot arise
        return torch.einsum("ghr,hvr->ghv", out, w_uv)

    def _sparse_triton(self, q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor,
                       positions: torch.Tensor) -> torch.Tensor:
        """``_sparse_absorbed`` in the Triton kernel, which reads the selected rows itself: q [G, h, n + p], table
        [G, W] (``context_table``), positions [G, K] (``selected_positions``) -> [G, h, v]."""
        from engine.kernels.sparse_mla import sparse_mla_decode_triton

        w_uk, w_uv = self._w_kv()
        qa = torch.cat([torch.einsum("ghn,hnr->ghr", q[..., :self.nope_dim], w_uk), q[..., self.nope_dim:]], dim=-1)
        latent_out = sparse_mla_decode_triton(qa, cache, table, positions, self.scale, self.kv_lora_rank)  # [G, h, r]
        return torch.einsum("ghr,hvr->ghv", latent_out, w_uv)

    def _prefill_selected(self, q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor,
                          select: torch.Tensor) -> torch.Tensor:
        """A prefill chunk's queries q [q, h, n + p], each over its own selected latent rows only (select [q, L]),
        read through the request's block table [W] -> [q, h, v].

        Queries go in slices of at most ``SLICE_BUDGET`` values of scratch: a query's positions, rows and scores
        exist only while its slice runs, so a long chunk over a long context holds a bounded amount at once.
        """
        num_queries, length = select.shape
        topk = min(self._index_topk(), length)  # K: every query sees itself, so each keeps between 1 and K rows
        triton = self.prefill_kernel == "triton" and not self.fp8_cache
        if triton:  # the kernel reads the rows itself: the absorbed query, its output and the positions remain
            per_query = self.num_heads * (2 * self.kv_lora_rank + self.rope_dim) + length
        else:
            per_query = topk * (self.kv_lora_rank + self.rope_dim + 2 * self.num_heads) + length
        step = max(1, SLICE_BUDGET // per_query)
        out = q.new_empty(num_queries, self.num_heads, self.v_dim)
        for lo in range(0, num_queries, step):
            part = slice(lo, lo + step)
            positions = selected_positions(select[part], topk)  # [s, K], -1 after a query's last selected token
            tables = table[None].expand(positions.shape[0], -1)  # [s, W]: the chunk's queries share their blocks
            if triton:
                out[part] = self._sparse_triton(q[part], cache, tables, positions)
            else:
                selected, valid = gather_selected_rows(cache, tables, positions)  # [s, K, r + p], [s, K]; padding 0
                out[part] = self._sparse_absorbed(q[part], self._latent_values(selected, q.dtype), valid)
        return out

    def _prefill_dense(self, q: torch.Tensor, ctx: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
        """Expanded: q [q, h, n + p] over the selected rows of ctx [L, r + p] (select [q, L]) -> [q, h, v]."""
        keys, values = self._expand(ctx[:, :self.kv_lora_rank], ctx[:, self.kv_lora_rank:])  # [L, h, n + p], [L, h, v]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            attn_mask=select[None, None], scale=self.scale,
        )  # [1, h, q, v]
        return o[0].transpose(0, 1)
