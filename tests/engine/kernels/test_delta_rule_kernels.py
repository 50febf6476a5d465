"""The Triton gated delta rule (per head: Gated DeltaNet; per key channel: KDA) against a float64 token-by-token loop
written from the recurrence and against the torch rules, over a step of mixed requests: decodes (one fresh, its
slot holding NaN), prompt chunks packed together (one fresh over several kernel blocks, one continuing from its
slot's state with a length that is no multiple of the block), two value heads reading one key head (per head),
dims that are no power of two (masked key channels, a partial value tile); then a second step decoding every
request from the states the first step wrote. Slots no request uses are left alone. Without a GPU it runs in
Triton's CPU interpreter (TRITON_INTERPRET=1 set here before anything imports triton)."""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.device_batch.state_metadata import build_state_metadata  # noqa: E402
from engine.kernels.delta_rule import DeltaRuleLaunch, delta_rule_triton  # noqa: E402
from engine.layers.delta_rule import chunked_delta_rule, recurrent_delta_rule  # noqa: E402
from engine.layers.kda_rule import chunked_kda_rule, recurrent_kda_rule  # noqa: E402
from engine.layers.state_rules import rule_over_requests  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HEADS, DK, DV, SLOTS = 2, 12, 20, 6
LAUNCH = DeltaRuleLaunch(chunk_per_head=16, chunk_per_channel=16, block_v=16)  # blocks of 16: short prompts cross


def _loop64(q, k, v, g, beta, state):
    """S_t = diag(exp(g_t)) S + k_t (beta_t (v_t - (diag(exp(g_t)) S)^T k_t))^T, o_t = S_t^T q_t; float64, one
    token at a time. q, k [L, hk, dk] (value head j reads key head j // (h / hk)); g [L, h, dk] (a per-head decay
    given to every channel alike)."""
    q, k, v, g, beta, s = (t.double().cpu() for t in (q, k, v, g, beta, state))
    r = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)  # [L, h, dk]
    out = []
    for t in range(q.shape[0]):
        s = g[t].exp()[:, :, None] * s  # [h, dk, dv]
        u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", s, k[t]))
        s = s + k[t][:, :, None] * u[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.stack(out), s


def _tokens(gen, n, per_channel):
    """One request's n tokens; per head (Gated DeltaNet) both value heads read one key head, as r = h / hk > 1."""
    key_heads = HEADS if per_channel else 1
    q = torch.nn.functional.normalize(torch.randn(n, key_heads, DK, generator=gen), dim=-1) * DK ** -0.5
    k = torch.nn.functional.normalize(torch.randn(n, key_heads, DK, generator=gen), dim=-1)
    v = torch.randn(n, HEADS, DV, generator=gen)
    g = -torch.rand(n, HEADS, *((DK,) if per_channel else ()), generator=gen) * 1.5  # log decays <= 0
    beta = torch.rand(n, HEADS, generator=gen)
    return q, k, v, g, beta


def _per_channel(g):
    return g if g.dim() == 3 else g[..., None].expand(*g.shape, DK)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_head", "per_channel"])
@pytest.mark.parametrize("draw", range(2))
def test_mixed_steps_match_float64_and_torch(per_channel, draw):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    rules = (recurrent_kda_rule, chunked_kda_rule) if per_channel else (recurrent_delta_rule, chunked_delta_rule)
    cache = torch.randn(SLOTS, HEADS, DK, DV, generator=gen)
    cache[1] = float("nan")  # the fresh decode's reused slot
    cache[3] = float("nan")  # the fresh prompt's
    start = cache.clone()
    # (slot, tokens this step, start position): a decode continuing, a fresh one-token prompt, a fresh prompt over
    # three blocks of 16 (the last partial), a chunk continuing from its state over two (the last partial).
    requests = [(0, 1, 9), (1, 1, 0), (3, 33, 0), (4, 17, 30)]
    history = {slot: [] for slot, _, _ in requests}
    ref_cache = cache.clone()
    for step in range(2):
        if step:  # every request decodes one token from the state the first step left
            requests = [(slot, 1, pos + n) for slot, n, pos in requests]
        parts, row = [], 0
        for slot, n, pos in requests:
            parts.append((row, row + n, slot, pos))
            row += n
        tokens = [_tokens(gen, n, per_channel) for _, n, _ in requests]
        for (slot, _, _), tok in zip(requests, tokens):
            history[slot].append(tok)
        q, k, v, g, beta = (torch.cat([t[i] for t in tokens]) for i in range(5))
        states = build_state_metadata(parts, DEVICE)
        cache_dev = cache.to(DEVICE)
        got = delta_rule_triton(*(x.to(DEVICE) for x in (q, k, v, g, beta)), cache_dev, states, LAUNCH).cpu()
        cache = cache_dev.cpu()
        want = rule_over_requests(*rules, ref_cache, q, k, v, g, beta, build_state_metadata(parts, torch.device("cpu")))
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5, msg=lambda m: f"seed={seed} step={step}: {m}")
        for (row, end, slot, _), (_, _, pos) in zip(parts, requests):
            seen = [torch.cat(field) for field in zip(*history[slot])]  # this request's tokens so far
            entering = torch.zeros(HEADS, DK, DV) if slot in (1, 3) else start[slot]
            ref_out, ref_state = _loop64(seen[0], seen[1], seen[2], _per_channel(seen[3]), seen[4], entering)
            torch.testing.assert_close(got[row:end].double(), ref_out[-(end - row):], atol=3e-5, rtol=1e-5,
                                       msg=lambda m: f"seed={seed} step={step} slot={slot}: {m}")
            torch.testing.assert_close(cache[slot].double(), ref_state, atol=3e-5, rtol=1e-5,
                                       msg=lambda m: f"seed={seed} step={step} slot={slot} state: {m}")
    for untouched in (2, 5):
        assert torch.equal(cache[untouched], start[untouched]), f"seed={seed}: slot {untouched} was written"


def test_bfloat16_values_and_strided_inputs():
    """The layers hand v and beta in the model dtype and v as a view of the convolved channels (rows strided):
    the kernels read them in place and compute in float32, as the torch rules do."""
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g, beta = _tokens(gen, 21, False)
    mixed = torch.randn(21, HEADS * DV + 5, generator=gen).to(torch.bfloat16)
    mixed[:, :HEADS * DV] = v.reshape(21, -1).to(torch.bfloat16)
    v = mixed[:, :HEADS * DV].view(21, HEADS, DV)  # row stride HEADS * DV + 5
    beta = beta.to(torch.bfloat16)
    cache = torch.randn(SLOTS, HEADS, DK, DV, generator=gen)
    parts = [(0, 1, 2, 4), (1, 21, 0, 7)]
    ref_cache = cache.clone()
    states = build_state_metadata(parts, DEVICE)
    cache_dev = cache.to(DEVICE)
    got = delta_rule_triton(*(x.to(DEVICE) for x in (q, k, v, g, beta)), cache_dev, states, LAUNCH).cpu()
    want = rule_over_requests(recurrent_delta_rule, chunked_delta_rule, ref_cache, q, k, v, g, beta,
                              build_state_metadata(parts, torch.device("cpu")))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5, msg=lambda m: f"seed={seed}: {m}")
    torch.testing.assert_close(cache_dev.cpu(), ref_cache, atol=2e-5, rtol=1e-5, msg=lambda m: f"seed={seed}: {m}")
