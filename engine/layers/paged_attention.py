"""Attention that writes and reads K/V through block tables (torch path, runs anywhere).

The interface (flat tokens + AttentionMetadata + per-layer cache tensors) is the
one a Triton paged-attention kernel implements on the GPU.

Slots a query does not see never reach its output: a reused block keeps an earlier request's K/V past this
request's length, and a decode group pads its block tables with block 0. The softmax weighs such slots 0,
but 0 * NaN and 0 * inf are NaN, so an earlier request's non-finite values (a broken adapter's) would still
poison the sum: every read of the cache goes through ``gather_visible``, which zeroes the hidden slots.

Attention sinks (gpt-oss): a learned logit per query head that joins each softmax's
denominator and attends to nothing, so a head can put weight on "no token". SDPA has no
such term; with sinks the same masks go through ``_sink_sdpa`` (explicit float32 math).
"""

import torch
import torch.nn.functional as F

from engine.device_batch.attention_metadata import AttentionMetadata, DecodeGroup


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    # caches [N_blocks, block_size, kvh, d]; k, v [T, kvh, d]; slot_mapping [T]
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    # cache [N_blocks, bs, kvh, d], block_table [..., n] -> [..., n*bs, kvh, d]
    block_size, num_kv_heads, head_dim = cache.shape[1:]
    rows = cache.view(cache.shape[0], -1).index_select(0, block_table.reshape(-1))  # [..*n, bs*kvh*d]
    return rows.view(*block_table.shape[:-1], block_table.shape[-1] * block_size, num_kv_heads, head_dim)


def gather_visible(cache: torch.Tensor, block_table: torch.Tensor, visible: torch.Tensor,
                   seen_by_all: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """The first L slots of ``block_table``'s blocks with every slot ``visible`` hides set to 0.

    cache [N_blocks, bs, kvh, d], block_table [..., n], visible [..., L] bool (L <= n * bs; True: some query
    sees the slot) -> [..., L, kvh, d]. Masked scores alone are not enough: see the module docstring.
    ``seen_by_all``: slots [lo, hi) that ``visible`` shows in every row, known on the host: only the slots
    outside them are masked (a decode group's tails), not the whole copy.
    """
    dim = visible.dim() - 1
    length = visible.shape[-1]
    rows = _gather(cache, block_table).narrow(dim, 0, length)  # [..., L, kvh, d], a copy: zeroed in place
    lo, hi = seen_by_all
    spans = ((0, lo), (hi, length)) if lo < hi else ((0, length),)
    for start, end in spans:
        if end <= start:
            continue
        hidden = ~visible.narrow(dim, start, end - start)  # [..., span]
        span = rows.narrow(dim, start, end - start)  # [..., span, kvh, d], a view: written through
        if span.device.type == "cpu":
            # On the CPU reading the mask costs no synchronisation, and usually nothing is hidden (a prefill
            # chunk's last query sees its whole context): zero only the hidden slots' rows, not a pass over all.
            where = hidden.nonzero(as_tuple=True)
            if where[0].numel():
                span[where] = 0
        else:
            span.masked_fill_(hidden[..., None, None], 0)
    return rows


def chunk_visibility(mask: torch.Tensor | None, start: int, end: int, seq_len: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Which context slots each query of a prefill chunk sees, and which slots any of its queries sees.

    The chunk is the batch's queries [start, end) over a context of ``seq_len`` slots; ``mask`` is its prefill
    mask [1, 1, q, L] bool (True: visible), or None where the chunk is the whole context, causal over its own
    tokens. -> (visible [q, L], seen [L]): ``seen`` is what ``gather_visible`` keeps of the context, ``visible``
    what the sparse layers' indexers choose their top-k keys within.
    """
    if mask is None:
        n = end - start
        visible = torch.ones(n, seq_len, dtype=torch.bool, device=device).tril(seq_len - n)  # [q, L]
    else:
        visible = mask[0, 0]  # [q, L]
    return visible, visible.any(dim=0)


def decode_context(caches: tuple[torch.Tensor | None, ...],
                   group: DecodeGroup) -> tuple[list[torch.Tensor | None], torch.Tensor]:
    """Each request's whole context in position order from each of ``caches`` (a group's shared prefix blocks
    first, then its own), for layers that must see every key at once (a sparse selection over the context).

    caches: each [N_blocks, bs, c, d] (None: skipped, None out) -> ([G, L, c, d] per cache, hidden slots zeroed;
    visibility [G, L] bool).
    """
    visible = group.key_mask[:, 0, 0]  # [G, L]
    parts = [None if c is None else gather_visible(c, group.block_table, visible, group.seen_by_all) for c in caches]
    if group.shared_blocks is not None:  # full prompt blocks every request of the group sees whole
        num_reqs = visible.shape[0]
        parts = [None if c is None else torch.cat([_gather(c, group.shared_blocks).expand(num_reqs, -1, -1, -1), own],
                                                  dim=1)
                 for c, own in zip(caches, parts)]
        visible = torch.cat([visible.new_ones(num_reqs, parts[0].shape[1] - visible.shape[1]), visible], dim=1)
    return parts, visible


def _sink_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
               scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """SDPA with a sink logit per head in the denominator: q [B, h, n, d], k/v [B, kvh, L, d], mask
    [B|1, 1, n, L] bool (True: visible) or ``causal``, sinks [h] -> [B, h, n, d] in q's dtype."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B, h, L, d]
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # [B, h, n, L]
    if causal:
        n, length = scores.shape[-2:]
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)  # [B, h, n, 1]
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # the sink's share dropped
    return (probs @ v.float()).to(q.dtype)


def _sdpa(q, k, v, mask, causal: bool, scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
    if sinks is not None:
        return _sink_sdpa(q, k, v, mask, causal, scale, sinks)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, h, d] against cached K/V (already holding this step's k, v [T, kvh, d]) -> [T, h, d].

    ``sinks`` [h]: per-head sink logits (this rank's heads), or None.
    """
    out = torch.empty_like(q)
    for group in meta.decode_groups:
        if group.shared_blocks is not None:
            out[group.start:group.end] = _shared_prefix_decode(q[group.start:group.end], k_cache, v_cache, group,
                                                               scale, sinks)
            continue
        visible = group.key_mask[:, 0, 0]  # [G, L]
        keys = gather_visible(k_cache, group.block_table, visible, group.seen_by_all)  # [G, L, kvh, d]
        values = gather_visible(v_cache, group.block_table, visible, group.seen_by_all)
        qd = q[group.start:group.end].unsqueeze(2)  # [G, h, 1, d]
        o = _sdpa(qd, keys.transpose(1, 2), values.transpose(1, 2), group.key_mask, False, scale, sinks)  # [G, h, 1, d]
        out[group.start:group.end] = o.squeeze(2)
    for (start, end), table, seq_len, mask in zip(
        meta.prefill_query_ranges, meta.prefill_block_tables, meta.prefill_seq_lens, meta.prefill_masks
    ):
        if mask is None:  # a fresh prompt chunk: its own keys, causal (the fast SDPA path)
            keys, values = k[start:end], v[start:end]  # [q, kvh, d]
        else:
            seen = mask[0, 0].any(dim=0)  # [L]: slots some query of the chunk sees (not those a window passed)
            keys = gather_visible(k_cache, table, seen)  # [L, kvh, d]
            values = gather_visible(v_cache, table, seen)
        # 4-D inputs: with 3-D ones the CPU backend falls back to the slow math path.
        o = _sdpa(q[start:end].transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],  # [1, h|kvh, q|L, d]
                  mask, mask is None, scale, sinks)  # [1, h, q, d]
        out[start:end] = o[0].transpose(0, 1)
    return out


def _partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float):
    """Softmax attention that also returns its max and normaliser, so parts over disjoint keys can be merged.

    q [..., n, d], k/v [..., L, d] -> (unnormalised out [..., n, d], max [..., n, 1], sum [..., n, 1]).
    """
    scores = (q @ k.transpose(-1, -2)) * scale  # [..., n, L]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    peak = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - peak)
    return weights @ v, peak, weights.sum(dim=-1, keepdim=True)


def _shared_prefix_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group, scale: float,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention for G requests whose tables start with the same blocks. q [G, h, d] -> [G, h, d].

    The shared keys are read once for the whole group instead of once per request.
    """
    num_reqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group_size = num_heads // num_kv_heads  # query heads per KV head
    q4 = q.view(num_reqs, num_kv_heads, group_size, head_dim)  # [G, kvh, g, d]

    # Shared part: every query of the group against the shared keys, as one batched matmul per KV head. Shared
    # blocks are full prompt blocks that every query sees whole: no slot of them is hidden.
    shared_k = _gather(k_cache, group.shared_blocks).transpose(0, 1)  # [kvh, S*bs, d]
    shared_v = _gather(v_cache, group.shared_blocks).transpose(0, 1)
    q_shared = q4.permute(1, 0, 2, 3).reshape(num_kv_heads, num_reqs * group_size, head_dim)  # [kvh, G*g, d]
    o1, m1, l1 = _partial_attention(q_shared, shared_k, shared_v, None, scale)  # [kvh, G*g, d|1]
    o1, m1, l1 = (t.view(num_kv_heads, num_reqs, group_size, -1).permute(1, 0, 2, 3) for t in (o1, m1, l1))

    # Own part: each request against its own (unshared) blocks; its newest token is always here.
    visible = group.key_mask[:, 0, 0]  # [G, L]
    own_k = gather_visible(k_cache, group.block_table, visible, group.seen_by_all).transpose(1, 2)  # [G, kvh, L, d]
    own_v = gather_visible(v_cache, group.block_table, visible, group.seen_by_all).transpose(1, 2)
    o2, m2, l2 = _partial_attention(q4, own_k, own_v, group.key_mask, scale)  # [G, kvh, g, d|1]

    peak = torch.maximum(m1, m2)
    a1, a2 = torch.exp(m1 - peak), torch.exp(m2 - peak)
    denominator = l1 * a1 + l2 * a2  # [G, kvh, g, 1]
    if sinks is not None:  # the sink is one more term of the softmax's sum
        denominator = denominator + torch.exp(sinks.to(peak.dtype).view(1, num_kv_heads, group_size, 1) - peak)
    out = (o1 * a1 + o2 * a2) / denominator  # [G, kvh, g, d]
    return out.reshape(num_reqs, num_heads, head_dim)
