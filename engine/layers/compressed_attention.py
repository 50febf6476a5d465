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

The paged cache holds, per token: its key row, and for compressed layers the compressor's raw projections (and the
indexer's for CSA). Compressed entries are recomputed from those rows for every request at every step: exact for
any chunking, preemption or prefix-cache hit (an entry depends only on its windows' tokens), and O(context) work
per step rather than incremental. Torch only.
"""

import torch
import torch.nn.functional as F
from torch import nn

from engine.device_batch.attention_metadata import AttentionMetadata
from engine.layers.cache_spec import CacheSpec
from engine.layers.float32_params import KeepsFloat32
from engine.layers.hyper_connections import unweighted_rms
from engine.layers.lightning_indexer import best_first
from engine.layers.paged_attention import _gather

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
                 norm: Float32RMSNorm, rope: Rope) -> torch.Tensor:
    """The compressed entries of a context's complete windows.

    raw [L, 2 * c] (projected kv then gate per token; c = 2 * width with ``overlap``, else width), rate m ->
    [L // m, width]: entry w is the gate-softmax-weighted sum of its slots' kv, normalised, rotated at w * m.
    With ``overlap`` its slots are window w-1's first halves then window w's second halves (window -1: none)."""
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
    cos, sin = rope.tables(torch.arange(n, device=raw.device) * rate)
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

    def entries(self, raw: torch.Tensor, rope: Rope) -> torch.Tensor:
        """raw [L, 2c], a context's cached rows from position 0 -> [L // m, width]."""
        return pool_windows(raw, self.rate, self.width, self.overlap, self.position_bias, self.kv_norm, rope)


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
    """Legend: T tokens, H hidden, h heads, d ``head_dim``, Q ``q_lora_rank``, g ``o_groups``, L a request's
    context, W its compressed entries, n a request's queries this step.

    Checkpoint names (``self_attn.*``): q_a_proj, q_a_norm, q_b_proj, kv_proj, kv_norm, o_a_proj [g * o_lora, h*d/g],
    o_b_proj, sinks [h], and ``compressor.*`` (with ``compressor.indexer.*`` for CSA)."""

    float32_params = ("sinks",)
    backends = ("torch",)
    num_kv_heads = 1  # one shared key=value row per token

    def __init__(self, kind: str, hidden_size: int, num_heads: int, head_dim: int, q_lora_rank: int,
                 o_groups: int, o_lora_rank: int, window: int, rope: Rope, eps: float, rate: int = 0,
                 index: dict | None = None) -> None:
        super().__init__()
        self.kind, self.num_heads, self.head_dim, self.window, self.rope, self.eps = \
            kind, num_heads, head_dim, window, rope, eps
        self.o_groups = o_groups
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

    def cache_spec(self) -> CacheSpec:
        """Per token: the key row [d]; compressed layers add the compressor's raw row, CSA the indexer's too."""
        shapes = [(self.head_dim,)]
        if self.compressor is not None:
            shapes.append((self.compressor.raw_width(),))
            if self.kind == CSA:
                shapes.append((self.compressor.indexer.raw_width(),))
        return CacheSpec(tuple(shapes))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x [T, H] (normalised), positions [T] -> [T, H]. Writes this step's rows at ``meta.slot_mapping``."""
        num_tokens = x.shape[0]
        cos, sin = self.rope.tables(positions)  # [T, p/2]
        q_resid = self.q_a_norm(self.q_a_proj(x))  # [T, Q]
        q = unweighted_rms(self.q_b_proj(q_resid).view(num_tokens, self.num_heads, self.head_dim), self.eps)
        q = self.rope.apply(q, cos, sin)  # [T, h, d]
        kv = self.rope.apply(self.kv_norm(self.kv_proj(x)), cos, sin)  # [T, d]
        rows = [kv]
        if self.compressor is not None:
            rows.append(self.compressor.project(x))
            if self.kind == CSA:
                rows.append(self.compressor.indexer.project(x))
        for cache, row in zip(self.kv_cache, rows):
            cache.view(-1, row.shape[-1]).index_copy_(0, meta.slot_mapping, row.to(cache.dtype))
        out = q.new_zeros(num_tokens, self.num_heads, self.head_dim)  # rows of no request (padding) stay 0
        for start, end, table, length in self._requests(meta):
            span = slice(start, end)
            ctx = [_gather(c.view(*c.shape[:2], 1, -1), table[None])[0, :length, 0] for c in self.kv_cache]
            out[span] = self._attend(q[span], x[span], q_resid[span], positions[span], cos[span], sin[span], ctx)
        out = self.rope.apply(out, cos, -sin)  # the values' rotation taken back at the query's position
        grouped = out.reshape(num_tokens, self.o_groups, -1)  # [T, g, h*d/g]
        w = self.o_a_proj.weight.view(self.o_groups, -1, grouped.shape[-1])  # [g, o_lora, h*d/g]
        return self.o_b_proj(torch.einsum("tgi,goi->tgo", grouped, w).flatten(1))

    def _requests(self, meta: AttentionMetadata):
        """(first query token, end, block table from position 0, context length) of each request this step."""
        block_size = self.kv_cache[0].shape[1]
        for group in meta.decode_groups:
            # No window in this family's metadata: each request's visible keys are a prefix of its own blocks,
            # after the blocks the group shares (whole prompt blocks every request sees).
            lengths = group.key_mask[:, 0, 0].sum(dim=-1).tolist()
            shared = 0 if group.shared_blocks is None else group.shared_blocks.numel()
            for i, length in enumerate(lengths):
                table = group.block_table[i]
                if shared:
                    table = torch.cat([group.shared_blocks, table])
                yield group.start + i, group.start + i + 1, table, shared * block_size + int(length)
        for (start, end), table, length in zip(meta.prefill_query_ranges, meta.prefill_block_tables,
                                               meta.prefill_seq_lens):
            yield start, end, table, length

    def _attend(self, q: torch.Tensor, x: torch.Tensor, q_resid: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, ctx: list[torch.Tensor]) -> torch.Tensor:
        """One request's n queries q [n, h, d] at positions pos [n] over its context rows ctx (each [L, *]) ->
        [n, h, d]."""
        keys = ctx[0]  # [L, d]
        key_pos = torch.arange(keys.shape[0], device=q.device)
        visible = (key_pos[None] <= pos[:, None]) & (key_pos[None] > pos[:, None] - self.window)  # [n, L]
        if self.compressor is not None:
            rate = self.compressor.rate
            entries = self.compressor.entries(ctx[1], self.rope)  # [W, d]
            done = torch.arange(entries.shape[0], device=q.device)[None] < ((pos + 1) // rate)[:, None]  # [n, W]
            if self.kind == CSA:
                indexer = self.compressor.indexer
                done = indexer.select(x, q_resid, cos, sin, indexer.entries(ctx[2], self.rope), done, self.rope)
            keys = torch.cat([keys, entries.to(keys.dtype)])
            visible = torch.cat([visible, done], dim=-1)
        scores = torch.einsum("nhd,ld->nhl", q.float(), keys.float()) * self.head_dim ** -0.5
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        sink = self.sinks.float().view(1, -1, 1).expand(scores.shape[0], -1, 1)  # [n, h, 1]
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        return torch.einsum("nhl,ld->nhd", probs, keys.float()).to(q.dtype)
