"""Sparse MLA attention (the lightning indexer's top-k, then MLA over the selected tokens) against a float64 loop
written from the definition: per query, every earlier token's index score, the best ``index_topk`` of them, and
softmax attention over those with the keys and values expanded from the latents. Fresh prefills, a chunk over a
cached prefix and a decode run in one step, with a shared prefix block in a decode group, through the paged cache."""

import math
import random

import pytest
import torch
from transformers import DeepseekV32Config

from engine.core.model_config import model_config_from_hf
from engine.core.scheduler import ScheduledRequest
from engine.layers import lightning_indexer
from engine.layers.lightning_indexer import LightningIndexer
from engine.layers.rotary import RotaryEmbedding
from engine.layers.sparse_mla_attention import SelectionRelay, SparseMLAttention
from engine.worker.batch_builder import build_batch

HIDDEN, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V_DIM = 32, 2, 12, 16, 8, 8, 12
INDEX_HEADS, INDEX_DIM, TOPK, BLOCK, THETA = 3, 16, 5, 4, 10000.0


def _layer(interleave: bool, seed: int) -> SparseMLAttention:
    hf = DeepseekV32Config(hidden_size=HIDDEN, num_attention_heads=HEADS, q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA,
                           qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM, num_hidden_layers=1,
                           rope_parameters=dict(rope_type="default", rope_theta=THETA))
    rotary = RotaryEmbedding(model_config_from_hf("DeepseekV32ForCausalLM", hf, []), ROPE, 64)
    indexer = LightningIndexer(HIDDEN, Q_LORA, INDEX_HEADS, INDEX_DIM, ROPE, TOPK, interleave)
    layer = SparseMLAttention(HIDDEN, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V_DIM, rotary, rope_interleave=True,
                              scale=(NOPE + ROPE) ** -0.5, indexer=indexer, relay=SelectionRelay(),
                              index_head_dim=INDEX_DIM)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():  # norms' weights and the key norm's bias too
            spread = 0.5 if p.dim() == 1 else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=gen) * spread + (p.dim() == 1))  # 1-D: around 1
    return layer


def _rope(x: torch.Tensor, pos: int, interleave: bool) -> torch.Tensor:
    """x [..., p] rotated by position ``pos``: pairs (2i, 2i+1) interleaved, else (i, i + p/2)."""
    p = x.shape[-1]
    out = x.clone()
    for i in range(p // 2):
        angle = pos / THETA ** (2 * i / p)
        a, b = (2 * i, 2 * i + 1) if interleave else (i, i + p // 2)
        out[..., a] = x[..., a] * math.cos(angle) - x[..., b] * math.sin(angle)
        out[..., b] = x[..., b] * math.cos(angle) + x[..., a] * math.sin(angle)
    return out


def _rms(x, w, eps=1e-6):
    return x / torch.sqrt((x * x).mean() + eps) * w


def _as_computed(*rows: torch.Tensor):
    return rows if len(rows) > 1 else rows[0]


def _reference(layer: SparseMLAttention, xs: torch.Tensor, interleave: bool, cached_latent=_as_computed,
               cached_key=_as_computed) -> tuple[torch.Tensor, list[int]]:
    """One request's tokens xs [n, H] -> each one's attention output [n, h, v] (float64), and how many tokens
    each query attends to (the best ``index_topk`` scores, the earlier token first among equal ones: a key that
    every positively weighted head scores below zero scores exactly 0, and such keys tie). ``cached_latent``
    (latent, k_pe) and ``cached_key`` (key) map a token's rows to what the cache gives back (as computed here)."""
    w = {k: v.double() for k, v in layer.state_dict().items()}
    ix = layer.indexer
    kv_b = w["kv_b_proj.weight"].view(HEADS, NOPE + V_DIM, KV_LORA)
    keys, values, index_keys = [], [], []
    for t, x in enumerate(xs.double()):
        ckv = w["kv_a_proj_with_mqa.weight"] @ x
        latent = _rms(ckv[:KV_LORA], w["kv_a_layernorm.weight"])
        latent, k_pe = cached_latent(latent, _rope(ckv[KV_LORA:], t, True))
        keys.append(torch.cat([kv_b[:, :NOPE] @ latent, k_pe.expand(HEADS, ROPE)], dim=-1))  # [h, n + p]
        values.append(kv_b[:, NOPE:] @ latent)  # [h, v]
        k = w["indexer.wk.weight"] @ x
        k = (k - k.mean()) / torch.sqrt(k.var(unbiased=False) + 1e-6)
        k = k * w["indexer.k_norm.weight"] + w["indexer.k_norm.bias"]
        index_keys.append(cached_key(torch.cat([_rope(k[:ROPE], t, interleave), k[ROPE:]])))
    outs, counts = [], []
    for t, x in enumerate(xs.double()):
        q_resid = _rms(w["q_a_proj.weight"] @ x, w["q_a_layernorm.weight"])
        q = (w["q_b_proj.weight"] @ q_resid).view(HEADS, NOPE + ROPE)
        q = torch.cat([q[:, :NOPE], _rope(q[:, NOPE:], t, True)], dim=-1)
        iq = (w["indexer.wq_b.weight"] @ q_resid).view(INDEX_HEADS, INDEX_DIM)
        iq = torch.cat([_rope(iq[:, :ROPE], t, interleave), iq[:, ROPE:]], dim=-1)
        head_w = (w["indexer.weights_proj.weight"] @ x) * INDEX_HEADS ** -0.5
        scores = [sum(float(head_w[h]) * max(float(iq[h] @ index_keys[j]) * INDEX_DIM ** -0.5, 0.0)
                      for h in range(INDEX_HEADS)) for j in range(t + 1)]
        chosen = sorted(range(t + 1), key=lambda j: (-scores[j], j))[:ix.index_topk]
        counts.append(len(chosen))
        head_out = []
        for h in range(HEADS):
            logits = torch.stack([q[h] @ keys[j][h] for j in chosen]) * layer.scale
            head_out.append(torch.softmax(logits, dim=0) @ torch.stack([values[j][h] for j in chosen]))
        outs.append(torch.stack(head_out))
    return torch.stack(outs), counts


def _run(layer: SparseMLAttention, xs: list[torch.Tensor], scheduled: list[ScheduledRequest],
         device: torch.device = torch.device("cpu")):
    """One step over ``scheduled`` (request r's token ids are 100 r + position) on ``device`` (the layer's and
    xs's) -> {(request, position): [h, v]}, and the step's metadata."""
    batch = build_batch(scheduled, "torch", BLOCK, None, 1, device)
    ids = batch.input_ids.tolist()
    x = torch.stack([xs[i // 100][i % 100] for i in ids])  # [T, H]
    with torch.no_grad():
        out = layer.attend(*layer.project(x, batch.positions), batch.meta)
    return {(i // 100, i % 100): out[row] for row, i in enumerate(ids)}, batch.meta


@pytest.mark.parametrize("interleave", [False, True], ids=["v32-rope-sliced", "glm5-rope"])
def test_sparse_attention_matches_float64_loop(monkeypatch, interleave):
    if not interleave:  # the indexer scores a few queries at a time (as it does over long contexts)
        monkeypatch.setattr(lightning_indexer, "SCORE_BUDGET", 3 * INDEX_HEADS * 10)
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    layer = _layer(interleave, seed)
    num_blocks = 16
    layer.kv_cache = tuple(torch.zeros(num_blocks + 1, BLOCK, *shape) for shape in layer.cache_spec().per_token)
    lengths = (13, 12, 10, 6)
    xs = [torch.randn(n, HIDDEN) for n in lengths]

    def part(r: int, start: int, n: int, blocks: list[int]) -> ScheduledRequest:
        return ScheduledRequest(None, n, blocks, True, start, [100 * r + p for p in range(start, start + n)])

    # Requests 0 and 1 share their first block (a shared prefix: prompt block 0 is the same latents for both, so
    # their first 4 tokens are request 0's); request 2 is prefilled in two chunks.
    xs[1][:BLOCK] = xs[0][:BLOCK]
    tables = [[0, 1, 2, 3], [0, 4, 5], [6, 7, 8], [9, 10]]
    got, _ = _run(layer, xs, [part(0, 0, 12, tables[0]), part(1, 0, 11, tables[1]), part(2, 0, 6, tables[2])])
    more, meta = _run(layer, xs, [part(0, 12, 1, tables[0]), part(1, 11, 1, tables[1]), part(2, 6, 4, tables[2]),
                                  part(3, 0, 6, tables[3])])
    got |= more
    assert [g.shared_blocks.tolist() for g in meta.decode_groups] == [[0]]  # the two decodes read block 0 once
    assert meta.prefill_masks[0] is not None and meta.prefill_masks[1] is None  # a chunk over its prefix; a fresh one
    dropped = 0
    for r, n in enumerate(lengths):
        want, counts = _reference(layer, xs[r], interleave)
        for t in range(n):
            torch.testing.assert_close(got[r, t].double(), want[t], rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"seed={seed} request {r} position {t}: {m}")
        dropped += sum(t + 1 - c for t, c in enumerate(counts))
    assert dropped > 0  # index_topk (5) is below most contexts: tokens were left out


def test_index_keys_have_a_cache_entry_and_dtype_of_their_own():
    """The indexer key is a cache tensor beside the latent rows, in its own dtype; the pool's block size counts it."""
    from types import SimpleNamespace

    from engine.core.config import CacheConfig
    from engine.worker.cache_groups import kv_bytes_per_block
    from engine.worker.cache_binding import attach_kv_caches

    layer = _layer(False, 0)
    layer.index_key_dtype = torch.float32
    model = SimpleNamespace(attention_layers=lambda: [layer])
    (caches,) = attach_kv_caches(model, CacheConfig(BLOCK, 6, True, None), torch.device("cpu"), torch.bfloat16)
    assert [(tuple(t.shape), t.dtype) for t in caches] == [((7, BLOCK, KV_LORA + ROPE), torch.bfloat16),
                                                          ((7, BLOCK, INDEX_DIM), torch.float32)]
    assert kv_bytes_per_block(model, BLOCK, torch.bfloat16) == BLOCK * ((KV_LORA + ROPE) * 2 + INDEX_DIM * 4)
