"""The gated delta rule's two torch forms against a float64 token-by-token loop written from the recurrence, and
against transformers' own torch reference: the chunked form over chunk boundaries (a chunk smaller than the
sequence, and one longer), from a non-zero entering state; the recurrent form stepping several requests at once."""

import random

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

from engine.layers.delta_rule import chunked_delta_rule, recurrent_delta_rule


def _loop64(q, k, v, g, beta, state):
    """S_t = a_t S + k_t (beta_t (v_t - a_t S^T k_t))^T, o_t = S_t^T q_t; float64, one token at a time."""
    q, k, v, g, beta, s = (t.double() for t in (q, k, v, g, beta, state))
    out = []
    for t in range(q.shape[0]):
        s = g[t].exp()[:, None, None] * s
        u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", s, k[t]))
        s = s + k[t][:, :, None] * u[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.stack(out), s


def _inputs(gen, length, heads=3, dk=8, dv=6):
    q = torch.nn.functional.normalize(torch.randn(length, heads, dk, generator=gen), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(length, heads, dk, generator=gen), dim=-1)
    v = torch.randn(length, heads, dv, generator=gen)
    g = -torch.rand(length, heads, generator=gen) * 2  # log decays <= 0
    beta = torch.rand(length, heads, generator=gen)
    return q, k, v, g, beta, torch.randn(heads, dk, dv, generator=gen)


@pytest.mark.parametrize("chunk", [7, 64])
def test_chunked_form_equals_the_recurrence(chunk):
    seed = random.randrange(2**31)
    q, k, v, g, beta, state = _inputs(torch.Generator().manual_seed(seed), 150)
    out, last = chunked_delta_rule(q, k, v, g, beta, state, chunk=chunk)
    ref_out, ref_last = _loop64(q, k, v, g, beta, state)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-5, msg=f"seed={seed}")
    torch.testing.assert_close(last.double(), ref_last, atol=2e-5, rtol=1e-5, msg=f"seed={seed}")
    # transformers' reference (it scales q itself): the same outputs
    hf_out, _ = torch_recurrent_gated_delta_rule(q[None] * q.shape[-1] ** 0.5, k[None], v[None], g[None], beta[None],
                                                 initial_state=state[None], output_final_state=True)
    torch.testing.assert_close(out, hf_out[0], atol=2e-5, rtol=1e-5, msg=f"seed={seed}")


def test_recurrent_steps_of_a_batch_equal_the_recurrence():
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    sequences = [_inputs(gen, 5) for _ in range(4)]
    states = torch.stack([s[-1] for s in sequences])  # [D, h, dk, dv]
    for t in range(5):
        out, states = recurrent_delta_rule(*(torch.stack([s[i][t] for s in sequences]) for i in range(5)), states)
        for d, seq in enumerate(sequences):
            ref_out, _ = _loop64(*(x[:t + 1] for x in seq[:5]), seq[5])
            torch.testing.assert_close(out[d].double(), ref_out[t], atol=2e-5, rtol=1e-5, msg=f"seed={seed}")
