"""DeepSeek-V4 attention: one shared key=value head over a sliding window, plus compressed entries.

Every layer: queries from a LoRA'd projection (normalised per head), one key row per token that is its own value
(normalised, rope on its last ``rope_dim`` channels, interleaved pairs), a learned sink logit per head, and a
grouped low-rank output projection; since the values carry the keys' rotation, the output's rope channels are
rotated back by the query's position. A query sees the last ``sliding_window`` tokens and, by layer kind:

- "sliding_attention": nothing more;
- "heavily_compressed_attention" (HCA): one entry per complete window of ``m`` tokens, a softmax-gated sum of
  the window's projected tokens (gates plus a learned bias per offset), normalised and rotated at the window's
  first position; query ``t`` sees the entries of windows that end at or before ``t``;
- "compressed_sparse_attention" (CSA): the same with overlapping windows (entry ``w`` mixes the previous window's
  first half-projection with this window's second), of which a lightning indexer (its own small compressor of
  the same windows, ``n_i`` query heads) keeps the ``index_topk`` best per query.

The engine keeps what transformers' cache keeps (``DeepseekV4HCACache`` / ``DeepseekV4CSACache``), laid out for
paging: the paged cache holds only the compressed entries (compressed layers; CSA's indexer entries beside them),
entry ``w`` spread over the slots of its own window's ``m`` tokens (``ceil(width / m)`` values each), so a
compressed layer costs ``width / m`` values per token; a per-request state (``window_rings``) holds the key rows
of the sliding window and the compressor's raw projections of the windows not yet complete. An entry is computed
once, in the step its window completes, from the state's raw rows and the step's own, and written into its
window's slots (which may lie in blocks a prefix-cache hit shares: every writer writes the entry of the same
tokens). Preemption recomputes a request from its first token; a prefix-cache hit resumes from a state
checkpoint (``engine.core.state_checkpoints``) at the hit's end. Torch only.

Tensor parallel: the query heads are split over the ranks (``q_b_proj`` by head rows, ``sinks`` by head, the
grouped output projection by whole groups: ``o_a_proj``'s rows and ``o_b_proj``'s columns of this rank's groups,
then a sum over the ranks). Everything the heads share is kept whole on every rank: the query latent (the
indexer reads it whole), the one key=value row per token, the compressors and the indexer, so every rank computes
the same entries, selection and state, and the per-request state and the paged entries are whole, not per head.
"""

import torch
import torch.nn.functional as F
from torch import nn

from engine.device_batch.attention_metadata import AttentionMetadata
from engine.device_batch.state_metadata import StateMetadata
from engine.distributed.collectives import SINGLE, TensorParallel
from engine.layers.cache_spec import CacheSpec, StateSpec
from engine.layers.float32_params import KeepsFloat32
from engine.layers.hyper_connections import unweighted_rms
from engine.layers.lightning_indexer import best_first
from engine.layers.window_rings import Ring, layout

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


class Float32RMSNorm(KeepsFloat32):
    """RMSNorm whose float32 weight multiplies in float32 before the one cast back (the reference's V4 norms)."""

    float32_params = ("weight",)

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (self.weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


class Rope:
    """Interleaved RoPE on the last ``dim`` channels (pairs (0,1), (2,3), ... rotate together, layout kept).

    ``inv_freq`` [dim/2] and the attention scaling come from the rope parameters (transformers' formulas for
    the scaled types); cos/sin are computed per call from float32 positions, as the reference does."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, dim: int) -> None:
        self.inv_freq, self.scaling, self.dim = inv_freq.float(), float(scaling), dim

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, dim/2] float32."""
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)
        return freqs.cos() * self.scaling, freqs.sin() * self.scaling

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, ..., d] with cos/sin [T, dim/2] (``-sin``: the inverse rotation) -> x rotated, same layout."""
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
        # The tables are rounded to x's dtype first (the reference hands them over in it), the rotation is float32.
        c, s = cos.to(x.dtype).view(shape).float(), sin.to(x.dtype).view(shape).float()
        rope = x[..., -self.dim:]
        x1, x2 = rope[..., 0::2].float(), rope[..., 1::2].float()
        rotated = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2).to(x.dtype)
        return torch.cat([x[..., :-self.dim], rotated], dim=-1)


def pool_windows(raw: torch.Tensor, rate: int, width: int, overlap: bool, position_bias: torch.Tensor,
                 norm: Float32RMSNorm, rope: Rope, first: int = 0) -> torch.Tensor:
    """The compressed entries of the complete windows of rows from window ``first`` on.

    raw [L, 2 * c] (projected kv then gate per token, from position first * m; c = 2 * width with ``overlap``,
    else width), rate m -> [L // m, width]: entry w is the gate-softmax-weighted sum of its slots' kv, normalised,
    rotated at its first position. With ``overlap`` its slots are the previous window's first halves then its own
    second halves (none before the rows' first window: drop that entry unless ``first`` is 0)."""
    n = raw.shape[0] // rate
    c = raw.shape[1] // 2
    kv = raw[:n * rate, :c].reshape(n, rate, c)
    gate = raw[:n * rate, c:].reshape(n, rate, c) + position_bias  # [n, m, c] float32
    if overlap:
        slots_kv = kv.new_zeros(n, 2 * rate, width)
        slots_gate = gate.new_full((n, 2 * rate, width), float("-inf"))
        slots_kv[:, rate:], slots_gate[:, rate:] = kv[..., width:], gate[..., width:]
        slots_kv[1:, :rate], slots_gate[1:, :rate] = kv[:-1, :, :width], gate[:-1, :, :width]
        kv, gate = slots_kv, slots_gate
    pooled = norm((kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1))  # [n, width]
    cos, sin = rope.tables((torch.arange(n, device=raw.device) + first) * rate)
    return rope.apply(pooled, cos, sin)


class Compressor(KeepsFloat32):
    """``kv_proj``, ``gate_proj`` [c, H], ``position_bias`` [m, c] (float32), ``kv_norm``: c = 2 * width when
    ``overlap`` (CSA), else width (HCA)."""

    float32_params = ("position_bias",)

    def __init__(self, hidden_size: int, width: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        c = 2 * width if overlap else width
        self.width, self.rate, self.overlap = width, rate, overlap
        self.kv_proj = nn.Linear(hidden_size, c, bias=False)
        self.gate_proj = nn.Linear(hidden_size, c, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, c, dtype=torch.float32))
        self.kv_norm = Float32RMSNorm(width, eps)

    def raw_width(self) -> int:
        return 2 * self.kv_proj.out_features

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> the row each token caches [T, 2c]: its kv then its gate projection."""
        return torch.cat([self.kv_proj(x), self.gate_proj(x)], dim=-1)

    def entries(self, raw: torch.Tensor, rope: Rope, first: int) -> torch.Tensor:
        """raw [L, 2c], rows from position first * m -> the entries of its complete windows [L // m, width]
        (with overlapping windows, window ``first``'s entry lacks its predecessor's rows unless ``first`` is 0:
        the caller reads those rows only to pool the next)."""
        return pool_windows(raw, self.rate, self.width, self.overlap, self.position_bias, self.kv_norm, rope, first)

    def slot_width(self) -> int:
        """Values per token slot of the paged cache: an entry of ``width`` spread over its window's m slots."""
        return -(-self.width // self.rate)

    def ring_rows(self) -> int:
        """Raw rows a request's state keeps: the open window's, and with overlap the one before it."""
        return 2 * self.rate if self.overlap else self.rate


class Indexer(Compressor):
    """CSA's lightning indexer: a compressor of width d_i (overlapping windows) plus ``q_b_proj`` [n_i * d_i, Q]
    (queries from the attention's query latent) and ``weights_proj`` [n_i, H] (a weight per head)."""

    def __init__(self, hidden_size: int, q_lora_rank: int, heads: int, head_dim: int, rate: int, topk: int,
                 eps: float) -> None:
        super().__init__(hidden_size, head_dim, rate, True, eps)
        self.heads, self.head_dim, self.topk = heads, head_dim, topk
        self.q_b_proj = nn.Linear(q_lora_rank, heads * head_dim, bias=False)
        self.weights_proj = nn.Linear(hidden_size, heads, bias=False)

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               keys: torch.Tensor, visible: torch.Tensor, rope: Rope) -> torch.Tensor:
        """Queries' hidden x [n, H], latent q_resid [n, Q], rope tables at their positions; compressed keys [W, d_i];
        visible [n, W] (complete before the query) -> [n, W] bool: the ``topk`` visible keys of highest
        ``sum_h w_h * relu(q_h . k) * d_i ** -0.5``, the earlier key first among equal scores."""
        n = x.shape[0]
        q = rope.apply(self.q_b_proj(q_resid).view(n, self.heads, self.head_dim), cos, sin)  # [n, n_i, d_i]
        scores = F.relu(torch.einsum("nhd,wd->nhw", q.float(), keys.float())) * self.head_dim ** -0.5
        weights = self.weights_proj(x).float() * self.heads ** -0.5  # [n, n_i]
        scores = (scores * weights[..., None]).sum(dim=1).masked_fill(~visible, float("-inf"))  # [n, W]
        chosen = torch.zeros_like(visible)
        chosen.scatter_(-1, best_first(scores)[:, :min(self.topk, keys.shape[0])], True)
        return chosen & visible


class CompressedAttention(KeepsFloat32):
    """Legend: T tokens, H hidden, h this rank's heads, d ``head_dim``, Q ``q_lora_rank``, g this rank's
    ``o_groups``, L a request's context, W its compressed entries, n a request's queries this step.

    Checkpoint names (``self_attn.*``): q_a_proj, q_a_norm, q_b_proj, kv_proj, kv_norm, o_a_proj [g * o_lora, h*d/g],
    o_b_proj, sinks [h], and ``compressor.*`` (with ``compressor.indexer.*`` for CSA). Under tensor parallelism h
    and g are this rank's shares (``tp_slices``)."""

    float32_params = ("sinks",)
    backends = ("torch",)
    num_kv_heads = 1  # one shared key=value row per token

    def __init__(self, kind: str, hidden_size: int, num_heads: int, head_dim: int, q_lora_rank: int,
                 o_groups: int, o_lora_rank: int, window: int, rope: Rope, eps: float, rate: int = 0,
                 index: dict | None = None, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        # A rank's heads must fill whole output groups (each group's low-rank projection reads its heads only).
        num_heads = tp.shard(num_heads, "the number of attention heads")[1]
        o_groups = tp.shard(o_groups, "o_groups (the output projection's head groups)")[1]
        self.kind, self.num_heads, self.head_dim, self.window, self.rope, self.eps = \
            kind, num_heads, head_dim, window, rope, eps
        self.o_groups, self.o_lora_rank = o_groups, o_lora_rank
        self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
        self.q_a_norm = Float32RMSNorm(q_lora_rank, eps)
        self.q_b_proj = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.kv_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.kv_norm = Float32RMSNorm(head_dim, eps)
        self.o_a_proj = nn.Linear(num_heads * head_dim // o_groups, o_groups * o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(o_groups * o_lora_rank, hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.empty(num_heads, dtype=torch.float32))
        self.compressor = None
        if kind != SLIDING:
            self.compressor = Compressor(hidden_size, head_dim, rate, kind == CSA, eps)
            if kind == CSA:
                self.compressor.indexer = Indexer(hidden_size, q_lora_rank, rate=rate, eps=eps, **index)
        self.kv_cache: tuple[torch.Tensor, ...] = ()  # bound by the runner, as ``cache_spec`` says

    def tp_slices(self, local_name: str, rank: int) -> tuple[slice, ...] | None:
        """This rank's part of checkpoint tensor ``self_attn.<local_name>`` (None: whole on every rank, as the
        shared key=value row, the compressors and the indexer are)."""
        rows = {"q_b_proj.weight": self.num_heads * self.head_dim, "sinks": self.num_heads,
                "o_a_proj.weight": self.o_groups * self.o_lora_rank}  # [h*d, Q], [h], [g * o_lora, h*d/g]
        if local_name in rows:
            n = rows[local_name]
            return (slice(rank * n, (rank + 1) * n),)
        if local_name == "o_b_proj.weight":  # [H, g * o_lora]: this rank's groups' columns
            n = self.o_groups * self.o_lora_rank
            return (slice(None), slice(rank * n, (rank + 1) * n))
        return None

    def compressors(self) -> list[Compressor]:
        """The layer's compressors: none (sliding), its own, or its own then the indexer's (CSA)."""
        if self.compressor is None:
            return []
        return [self.compressor] + ([self.compressor.indexer] if self.kind == CSA else [])

    def cache_spec(self) -> CacheSpec:
        """Per token: a compressed layer's share of each compressor's entries (``Compressor.slot_width``);
        nothing for a sliding layer, whose key rows live in the per-request state."""
        return CacheSpec(tuple((c.slot_width(),) for c in self.compressors()))

    def rings(self) -> list[Ring]:
        """The state's streams: the window's key rows, then each compressor's raw rows."""
        return layout([(self.window, self.head_dim)] + [(c.ring_rows(), c.raw_width()) for c in self.compressors()])

    def state_spec(self) -> StateSpec:
        """One request's state: its rings, flat, in the model's dtype (``window_rings``)."""
        return StateSpec((sum(r.values for r in self.rings()),), (0,))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x [T, H] (normalised), positions [T] -> [T, H]. Reads and updates each request's state at its slot
        (``meta.states``) and writes the entries its windows complete this step into its blocks."""
        num_tokens = x.shape[0]
        cos, sin = self.rope.tables(positions)  # [T, p/2]
        q_resid = self.q_a_norm(self.q_a_proj(x))  # [T, Q]
        q = unweighted_rms(self.q_b_proj(q_resid).view(num_tokens, self.num_heads, self.head_dim), self.eps)
        q = self.rope.apply(q, cos, sin)  # [T, h, d]
        rows = [self.rope.apply(self.kv_norm(self.kv_proj(x)), cos, sin)]  # key rows [T, d]
        rows += [c.project(x) for c in self.compressors()]  # raw rows [T, 2c] each
        out = q.new_zeros(num_tokens, self.num_heads, self.head_dim)  # rows of no request (padding) stay 0
        first_positions = positions.tolist()
        for start, end, table, slot in self._requests(meta):
            span = slice(start, end)
            state = self.state_cache[0][slot]  # [S] this request's rings
            out[span] = self._attend(q[span], x[span], q_resid[span], positions[span], first_positions[start],
                                     cos[span], sin[span], [r[span] for r in rows], state, table)
        out = self.rope.apply(out, cos, -sin)  # the values' rotation taken back at the query's position
        grouped = out.reshape(num_tokens, self.o_groups, -1)  # [T, g, h*d/g]
        w = self.o_a_proj.weight.view(self.o_groups, -1, grouped.shape[-1])  # [g, o_lora, h*d/g]
        return self.tp.all_reduce(self.o_b_proj(torch.einsum("tgi,goi->tgo", grouped, w).flatten(1)))

    def _requests(self, meta: AttentionMetadata):
        """(first query token, end, block table from position 0 or None for a sliding layer, state slot) of each
        request this step."""
        states: StateMetadata = meta.states
        decode_slots = states.decode_slots.tolist()
        for group in meta.decode_groups:
            shared = group.shared_blocks  # whole prompt blocks every request of the group sees, then its own
            for i in range(group.block_table.shape[0]):
                table = None
                if self.compressor is not None:
                    table = group.block_table[i] if shared is None else torch.cat([shared, group.block_table[i]])
                yield group.start + i, group.start + i + 1, table, decode_slots[group.start + i]
        slots = {row: slot for row, _, slot, _ in states.prefills}
        for (start, end), table in zip(meta.prefill_query_ranges, meta.prefill_block_tables):
            yield start, end, table, slots[start]

    def _attend(self, q: torch.Tensor, x: torch.Tensor, q_resid: torch.Tensor, pos: torch.Tensor, p0: int,
                cos: torch.Tensor, sin: torch.Tensor, rows: list[torch.Tensor], state: torch.Tensor,
                table: torch.Tensor | None) -> torch.Tensor:
        """One request's n queries q [n, h, d] at positions pos [n] (from p0), with the step's key and raw rows,
        over its state (the window's keys, the open windows' raw rows) and the entries in its blocks -> [n, h, d]."""
        n = q.shape[0]
        rings = self.rings()
        lo = max(0, p0 - self.window + 1)
        keys = rings[0].extend(state, lo, p0, rows[0])  # [p0 + n - lo, d]
        rings[0].keep(state, keys, lo, p0 + n - self.window + 1)
        key_pos = lo + torch.arange(keys.shape[0], device=q.device)
        visible = (key_pos[None] <= pos[:, None]) & (key_pos[None] > pos[:, None] - self.window)  # [n, L]
        entries = [self._entries(c, ring, state, rows[i + 1], p0, n, table, kv_cache)
                   for i, (c, ring, kv_cache) in enumerate(zip(self.compressors(), rings[1:], self.kv_cache))]
        if entries:
            complete = (pos + 1) // self.compressor.rate  # [n] entries whose windows end at or before the query
            done = torch.arange(entries[0].shape[0], device=q.device)[None] < complete[:, None]  # [n, W]
            if self.kind == CSA:
                done = self.compressor.indexer.select(x, q_resid, cos, sin, entries[1], done, self.rope)
            keys = torch.cat([keys, entries[0].to(keys.dtype)])
            visible = torch.cat([visible, done], dim=-1)
        scores = torch.einsum("nhd,ld->nhl", q.float(), keys.float()) * self.head_dim ** -0.5
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        sink = self.sinks.float().view(1, -1, 1).expand(scores.shape[0], -1, 1)  # [n, h, 1]
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        return torch.einsum("nhl,ld->nhd", probs, keys.float()).to(q.dtype)

    def _entries(self, compressor: Compressor, ring: Ring, state: torch.Tensor, raw: torch.Tensor, p0: int, n: int,
                 table: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """Every entry of the request's windows complete by p0 + n [W, width]: those before p0's window read from
        its blocks, those its windows complete this step pooled from the state's and the step's raw rows [n, 2c]
        and written into their windows' slots."""
        m, width, per_slot = compressor.rate, compressor.width, compressor.slot_width()
        k0, k1 = p0 // m, (p0 + n) // m  # entries [k0, k1) complete this step
        first = max(k0 - 1, 0) if compressor.overlap else k0  # the window the raw rows start at
        segment = ring.extend(state, first * m, p0, raw)  # [p0 + n - first * m, 2c]
        ring.keep(state, segment, first * m, max(k1 - 1, 0) * m if compressor.overlap else k1 * m)
        slots = cache.view(-1, per_slot)  # [(num_blocks + 1) * bs, per_slot]
        block_size = cache.shape[1]

        def slot_ids(lo: int, hi: int) -> torch.Tensor:  # the slots of positions [lo, hi)
            at = torch.arange(lo, hi, device=table.device)
            return table[at // block_size] * block_size + at % block_size

        old = slots.index_select(0, slot_ids(0, k0 * m)).view(k0, m * per_slot)[:, :width]  # [k0, width]
        if k1 == k0:
            return old
        new = compressor.entries(segment, self.rope, first)[k0 - first:].to(cache.dtype)  # [k1 - k0, width]
        spread = F.pad(new, (0, m * per_slot - width)).view(-1, per_slot)  # [(k1 - k0) * m, per_slot]
        slots.index_copy_(0, slot_ids(k0 * m, k1 * m), spread)
        return torch.cat([old, new])
