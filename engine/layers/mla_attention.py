"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of latents.

Each token caches one row of ``kv_lora_rank + qk_rope_head_dim`` values per layer (its normalised KV latent,
then its rotated shared rope key), instead of K and V for every head. Queries meet it in two forms:

- **prefill, expanded**: the latents of the chunk's context go through ``kv_b_proj`` to per-head keys
  ``[k_nope, k_pe]`` and values, then ordinary causal attention (the matrix work is per context token,
  which a prompt pays once anyway);
- **decode, absorbed**: ``kv_b_proj``'s key half is folded into the query (``q_nope @ W_UK``: a query in
  latent space) and its value half applied after attention (``out_latent @ W_UV``), so one decode token
  reads the cached rows as they are: every head attends over the same ``r + p`` wide keys and ``r`` wide
  values (the first ``r`` values of each row), with no per-token expansion.

Tensor parallel: heads split over the ranks (``q_proj``/``q_b_proj``/``kv_b_proj`` by head rows, ``o_proj`` by
head columns); the latent projections are replicated, so every rank caches the same latents (as vLLM does).
"""

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.collectives import SINGLE, TensorParallel
from engine.layers.cache_spec import CacheSpec
from engine.layers.norms import RMSNorm
from engine.layers.paged_attention import _gather, _partial_attention, gather_visible
from engine.layers.rotary import RotaryEmbedding
from engine.device_batch.attention_metadata import AttentionMetadata, DecodeGroup, TritonAttentionMetadata

LATENT_NORM_EPS = 1e-6  # DeepSeek's q_a_layernorm / kv_a_layernorm use the RMSNorm default, not rms_norm_eps


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """RoPE on x [T, heads, p] with cos/sin [T, 1, p] (``cat(freqs, freqs)`` tables).

    ``interleaved`` (DeepSeek's checkpoints): pairs (x0, x1), (x2, x3), ... rotate together; the result is laid
    out evens then odds. Queries and keys get the same layout, so their dot products are those of the pairs.
    """
    if interleaved:
        half = x.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class MLAttention(nn.Module):
    """Legend: T tokens, H hidden, h this rank's query heads, r ``kv_lora_rank``, p ``qk_rope_head_dim``,
    n ``qk_nope_head_dim``, v ``v_head_dim``, G decode requests of a group, L context.

    ``q_lora_rank`` None: a plain ``q_proj`` (DeepSeek-V2-Lite); else ``q_a_proj``, its norm and ``q_b_proj``.
    ``scale``: the softmax scale (DeepSeek's ``qk_head_dim ** -0.5``, times YaRN's ``mscale_all_dim`` factor squared).
    ``decode_form``: "absorbed" (the default) or "expanded" (decode as prefill does: for comparison).
    """

    backends = ("torch", "triton")  # attention backends it runs under (the runner falls back to torch otherwise)

    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, rotary: RotaryEmbedding,
                 rope_interleave: bool, scale: float, bias: bool = False, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.total_heads = num_heads
        self.num_heads = h = tp.shard(num_heads, "the number of attention heads")[1]
        self.num_kv_heads = 1  # one latent row shared by every head (what the decode-split heuristics count)
        self.kv_lora_rank, self.nope_dim, self.rope_dim, self.v_dim = kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_dim = qk_nope_head_dim + qk_rope_head_dim
        self.q_lora_rank = q_lora_rank
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, h * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(q_lora_rank, h * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(kv_lora_rank, h * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * v_head_dim, hidden_size, bias=bias)  # row-parallel: rank 0 alone loads its bias
        self.rotary, self.rope_interleave, self.scale = rotary, rope_interleave, scale
        self.decode_form = "absorbed"
        # [N_blocks + 1, block_size, r + p]: latent first, rope key last; bound by the runner.
        self.kv_cache: tuple[torch.Tensor, ...] = (torch.empty(0),)

    def cache_spec(self) -> CacheSpec:
        """One latent row per token: ``kv_lora_rank + qk_rope_head_dim`` values, the same on every rank."""
        return CacheSpec(((self.kv_lora_rank + self.rope_dim,),))

    def project_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per-token shapes of what ``project`` returns (q, latent, k_pe); ``attend_shape``: of ``attend``'s output."""
        return (self.num_heads, self.qk_dim), (self.kv_lora_rank,), (self.rope_dim,)

    def attend_shape(self) -> tuple[int, ...]:
        return self.num_heads, self.v_dim

    def tp_slices(self, local_name: str, rank: int) -> tuple[slice, ...] | None:
        """This rank's part of checkpoint tensor ``self_attn.<local_name>`` (None: replicated, whole)."""
        per_head_rows = {"q_proj.weight": self.qk_dim, "q_b_proj.weight": self.qk_dim,
                         "kv_b_proj.weight": self.nope_dim + self.v_dim}
        if local_name in per_head_rows:
            n = self.num_heads * per_head_rows[local_name]
            return (slice(rank * n, (rank + 1) * n),)
        if local_name == "o_proj.weight":
            n = self.num_heads * self.v_dim
            return (slice(None), slice(rank * n, (rank + 1) * n))
        return None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.output(self.attend(*self.project(x, positions), meta))  # [T, H]

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x [T, H] -> q [T, h, n + p] (rope part rotated), latent [T, r] (normalised), k_pe [T, p] (rotated)."""
        q_resid = None if self.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(x))  # [T, q_lora_rank]
        return self.project_from(x, q_resid, positions)

    def project_from(self, x: torch.Tensor, q_resid: torch.Tensor | None, positions: torch.Tensor):
        """``project`` given the normalised query latent ``q_resid`` [T, q_lora_rank] (None without q LoRA), which
        sparse attention's indexer reads too."""
        q, latent, k_pe = self.project_unrotated(x, q_resid)
        cos = self.rotary.cos_cache[positions].to(q.dtype)[:, None, :]  # [T, 1, p]
        sin = self.rotary.sin_cache[positions].to(q.dtype)[:, None, :]
        q_pe = rotate(q[..., self.nope_dim:], cos, sin, self.rope_interleave)
        q = torch.cat([q[..., :self.nope_dim], q_pe], dim=-1)
        k_pe = rotate(k_pe[:, None, :], cos, sin, self.rope_interleave)[:, 0]  # [T, p]
        return q, latent, k_pe

    def project_unrotated(self, x: torch.Tensor, q_resid: torch.Tensor | None = None):
        """x [T, H] -> q [T, h, n + p], latent [T, r] (normalised), k_pe [T, p]: ``project`` before the rotation
        (``q_resid``: the normalised query latent when the caller made it already)."""
        num_tokens = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)) if q_resid is None else q_resid)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        return q.view(num_tokens, self.num_heads, self.qk_dim), self.kv_a_layernorm(latent), k_pe

    def attend(self, q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
               meta: AttentionMetadata | TritonAttentionMetadata) -> torch.Tensor:
        """Writes [latent, k_pe] at ``meta.slot_mapping``, returns [T, h, v]."""
        (cache,) = self.kv_cache
        width = self.kv_lora_rank + self.rope_dim
        cache.view(-1, width).index_copy_(0, meta.slot_mapping, torch.cat([latent, k_pe], dim=-1))
        rows = cache.view(*cache.shape[:2], 1, width)  # [N, bs, 1, r + p]: the layout the gather helpers read
        out = q.new_empty(q.shape[0], self.num_heads, self.v_dim)
        if isinstance(meta, TritonAttentionMetadata):
            return self._attend_triton(q, latent, k_pe, meta, rows, out)
        for group in meta.decode_groups:
            decode = self._decode_absorbed if self.decode_form == "absorbed" else self._decode_expanded
            out[group.start:group.end] = decode(q[group.start:group.end], rows, group)
        for (start, end), table, seq_len, mask in zip(
            meta.prefill_query_ranges, meta.prefill_block_tables, meta.prefill_seq_lens, meta.prefill_masks
        ):
            out[start:end] = self._prefill(q[start:end], latent[start:end], k_pe[start:end], rows, table, seq_len, mask)
        return out

    def _attend_triton(self, q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, meta: TritonAttentionMetadata,
                       rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Decodes absorbed in the Triton MLA kernel (no host sync: CUDA graphs capture it); prefill chunks in the
        expanded torch form, their extents from the metadata's host copy."""
        from engine.kernels.mla_attention import mla_decode_triton

        num_decodes = meta.num_decodes
        if num_decodes:
            w_uk, w_uv = self._w_kv()
            qa = torch.cat([torch.einsum("dhn,hnr->dhr", q[:num_decodes, :, :self.nope_dim], w_uk),
                            q[:num_decodes, :, self.nope_dim:]], dim=-1)  # [D, h, r + p]
            latent_out = mla_decode_triton(qa, self.kv_cache[0], meta.decode_block_table, meta.decode_seq_lens,
                                           self.scale, self.kv_lora_rank)  # [D, h, r]
            out[:num_decodes] = torch.einsum("dhr,hvr->dhv", latent_out, w_uv)
        if meta.num_prefills:
            assert len(meta.prefill_extents) == meta.num_prefills, "the batch builder gives every chunk's extent"
            block_size = rows.shape[1]
            for i, (start, n, seq_len) in enumerate(meta.prefill_extents):
                mask = None
                if seq_len > n:  # a chunk over a cached prefix: query j sees keys up to its own position
                    query_pos = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]  # [q, 1]
                    mask = (torch.arange(seq_len, device=q.device)[None, :] <= query_pos)[None, None]  # [1, 1, q, L]
                table = meta.prefill_block_table[i, :-(-seq_len // block_size)]
                end = start + n
                out[start:end] = self._prefill(q[start:end], latent[start:end], k_pe[start:end], rows, table, seq_len, mask)
        return out

    def _prefill(self, q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, rows: torch.Tensor,
                 table: torch.Tensor, seq_len: int, mask: torch.Tensor | None) -> torch.Tensor:
        """One prefill chunk, expanded: q [q, h, n + p] over its context -> [q, h, v]. ``mask`` None: the chunk is
        the whole context (its own latents, causal); else the context's latents are read from the cache."""
        if mask is None:
            ctx_latent, ctx_pe = latent, k_pe
        else:
            ctx = gather_visible(rows, table, mask[0, 0].any(dim=0))[:, 0]  # [L, r + p]; hidden slots zeroed
            ctx_latent, ctx_pe = ctx[:, :self.kv_lora_rank], ctx[:, self.kv_lora_rank:]
        keys, values = self._expand(ctx_latent, ctx_pe)  # [L, h, n + p], [L, h, v]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            attn_mask=mask, is_causal=mask is None, scale=self.scale,
        )  # [1, h, q, v]
        return o[0].transpose(0, 1)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """out [T, h, v] -> [T, H]: o_proj, summed over the tensor-parallel ranks."""
        return self.tp.all_reduce(self.o_proj(out.reshape(out.shape[0], self.num_heads * self.v_dim)))

    # ---- the two forms ------------------------------------------------------
    def _w_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight per head: W_UK [h, n, r] (latent -> key) and W_UV [h, v, r] (latent -> value)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

    def _expand(self, latent: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [..., L, r], k_pe [..., L, p] -> keys [..., L, h, n + p], values [..., L, h, v]."""
        kv = self.kv_b_proj(latent).unflatten(-1, (self.num_heads, self.nope_dim + self.v_dim))
        k_nope, values = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k_pe = k_pe.unsqueeze(-2).expand(*k_nope.shape[:-1], self.rope_dim)
        return torch.cat([k_nope, k_pe], dim=-1), values

    def _decode_absorbed(self, q: torch.Tensor, rows: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        """q [G, h, n + p] against the group's cached rows in latent space -> [G, h, v]."""
        w_uk, w_uv = self._w_kv()
        r = self.kv_lora_rank
        q_latent = torch.einsum("ghn,hnr->ghr", q[..., :self.nope_dim], w_uk)
        qa = torch.cat([q_latent, q[..., self.nope_dim:]], dim=-1)  # [G, h, r + p]
        visible = group.key_mask[:, 0, 0]  # [G, L]
        own = gather_visible(rows, group.block_table, visible, group.seen_by_all)[:, :, 0]  # [G, L, r + p]
        if group.shared_blocks is None:
            # One "KV head" with the h queries as its rows: [G, 1, h, r + p] against [G, 1, L, r + p].
            out = F.scaled_dot_product_attention(qa[:, None], own[:, None], own[:, None, :, :r],
                                                 attn_mask=group.key_mask, scale=self.scale)[:, 0]  # [G, h, r]
        else:  # the shared prefix read once for the group, merged with each request's own rows by log-sum-exp
            num_reqs = q.shape[0]
            shared = _gather(rows, group.shared_blocks)[:, 0]  # [S*bs, r + p]
            o1, m1, l1 = _partial_attention(qa.reshape(-1, r + self.rope_dim), shared, shared[:, :r], None, self.scale)
            o1, m1, l1 = (t.view(num_reqs, self.num_heads, -1) for t in (o1, m1, l1))  # [G, h, r|1]
            o2, m2, l2 = _partial_attention(qa, own, own[..., :r], group.key_mask[:, 0], self.scale)  # [G, h, r|1]
            peak = torch.maximum(m1, m2)
            a1, a2 = torch.exp(m1 - peak), torch.exp(m2 - peak)
            out = (o1 * a1 + o2 * a2) / (l1 * a1 + l2 * a2)  # [G, h, r]
        return torch.einsum("ghr,hvr->ghv", out, w_uv)

    def _decode_expanded(self, q: torch.Tensor, rows: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        """q [G, h, n + p] against the group's cached rows expanded to per-head keys and values -> [G, h, v]."""
        visible = group.key_mask[:, 0, 0]  # [G, L]
        ctx = gather_visible(rows, group.block_table, visible, group.seen_by_all)[:, :, 0]  # [G, L, r + p]
        mask = group.key_mask  # [G, 1, 1, L]
        if group.shared_blocks is not None:  # attention is order-free: the shared rows simply join each context
            shared = _gather(rows, group.shared_blocks)[:, 0]  # [S*bs, r + p]
            ctx = torch.cat([shared.expand(q.shape[0], -1, -1), ctx], dim=1)
            mask = torch.cat([mask.new_ones(*mask.shape[:3], shared.shape[0]), mask], dim=-1)
        keys, values = self._expand(ctx[..., :self.kv_lora_rank], ctx[..., self.kv_lora_rank:])  # [G, L, h, .]
        out = F.scaled_dot_product_attention(q[:, :, None], keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=mask, scale=self.scale)  # [G, h, 1, v]
        return out[:, :, 0]
