"""The sampler's penalties, logit_bias, min_p and logprobs against plain float64 Python loops, on random logits
and random token histories, in batches that mix requests with and without each option."""

import math
import random

import pytest
import torch

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.sampling.penalties import apply_min_p, apply_penalty_inputs, penalty_inputs
from engine.sampling.sampler import Sampler

VOCAB = 97


def reference_adjust(logits: list[float], prompt: list[int], output: list[int], p: SamplingParams) -> list[float]:
    """The documented order, one token at a time: repetition (prompt + output), frequency and presence
    (output only), then logit_bias."""
    out = [float(x) for x in logits]
    seen = set(prompt) | set(output)
    for t in range(len(out)):
        if t in seen and p.repetition_penalty != 1.0:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        count = output.count(t)
        out[t] -= p.frequency_penalty * count + (p.presence_penalty if count else 0.0)
    for t, b in (p.logit_bias or {}).items():
        out[t] += b
    return out


def random_params(rng: random.Random) -> SamplingParams:
    kinds = rng.sample(["rep", "freq", "pres", "bias"], rng.randint(0, 4))  # some rows ask for nothing
    return SamplingParams(
        temperature=0.0,
        repetition_penalty=rng.uniform(0.5, 2.0) if "rep" in kinds else 1.0,
        frequency_penalty=rng.uniform(-2, 2) if "freq" in kinds else 0.0,
        presence_penalty=rng.uniform(-2, 2) if "pres" in kinds else 0.0,
        logit_bias={rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randint(1, 6))}
        if "bias" in kinds else None,
    )


def random_requests(rng: random.Random, n: int) -> list[Request]:
    reqs = []
    for i in range(n):
        req = Request(f"r{i}", [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))], random_params(rng), 100)
        for _ in range(rng.randint(0, 40)):  # repeats on purpose: a small pool of tokens
            req.append_output_token(rng.randrange(VOCAB // 4))
        reqs.append(req)
    return reqs


def test_penalties_and_logit_bias_match_reference():
    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    for _ in range(5):
        reqs = random_requests(rng, rng.randint(1, 12))
        logits = torch.randn(len(reqs), VOCAB, generator=torch.Generator().manual_seed(rng.randrange(2**31))) * 3
        expected = [reference_adjust(row, r.prompt_token_ids, r.output_token_ids, r.sampling_params)
                    for row, r in zip(logits.double().tolist(), reqs)]
        got = logits.clone()
        inputs = penalty_inputs(reqs, VOCAB, got.device)
        if inputs is not None:  # None when no request adjusts: the logits must then equal the reference as they are
            apply_penalty_inputs(got, inputs)
        assert torch.allclose(got.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-4), f"seed={seed}"
        # Greedy sampling follows the adjusted logits.
        tokens = Sampler(torch.device("cpu"), seed=0)(logits.clone(), reqs).token_ids
        assert tokens == [max(range(VOCAB), key=row.__getitem__) for row in expected], f"seed={seed}"


def test_min_p_matches_reference():
    rng = random.Random()
    probs = torch.softmax(torch.randn(6, VOCAB) * 2, dim=-1)
    min_ps = [0.0, rng.uniform(0, 1), 0.0, rng.uniform(0, 0.2), 1.0, rng.uniform(0, 0.05)]
    got = apply_min_p(probs, min_ps).double().tolist()
    for row, m, out in zip(probs.double().tolist(), min_ps, got):
        top = max(row)
        assert out == pytest.approx([x if x >= m * top else 0.0 for x in row], abs=1e-9)


def test_min_p_restricts_samples_in_a_mixed_batch():
    logits = torch.randn(1, VOCAB) * 3
    probs = torch.softmax(logits[0].double(), -1)
    allowed = set((probs >= 0.3 * probs.max()).nonzero()[:, 0].tolist())
    n = 400
    reqs = [Request(str(i), [1], SamplingParams(temperature=1.0, min_p=0.3 if i % 2 else 0.0), 10) for i in range(n)]
    tokens = Sampler(torch.device("cpu"), seed=random.randrange(2**31))(logits.repeat(n, 1), reqs).token_ids
    assert set(tokens[1::2]) <= allowed
    assert not set(tokens[0::2]) <= allowed  # the rows without min_p still draw from the whole vocabulary


def test_logprobs_match_reference_and_are_raw():
    """Logprobs are of the raw logits: temperature, penalties and bias change the draw, not the reported values."""
    rng = random.Random()
    reqs = random_requests(rng, 8)
    for i, r in enumerate(reqs):
        r.sampling_params.logprobs = [None, 0, 5, 20][i % 4]
        r.sampling_params.temperature = rng.choice([0.0, 0.7, 1.5])
    logits = torch.randn(len(reqs), VOCAB) * 2
    out = Sampler(torch.device("cpu"), seed=1)(logits.clone(), reqs)
    for row, r, token, lp in zip(logits.double().tolist(), reqs, out.token_ids, out.logprobs):
        k = r.sampling_params.logprobs
        if k is None:
            assert lp is None
            continue
        norm = math.log(sum(math.exp(x) for x in row))
        ref = [x - norm for x in row]
        assert lp.token_ids == [token] and lp.logprobs[0] == pytest.approx(ref[token], abs=1e-5)
        order = sorted(range(VOCAB), key=lambda t: -ref[t])[:k]
        assert lp.top_ids[0] == order
        assert lp.top_logprobs[0] == pytest.approx([ref[t] for t in order], abs=1e-5)


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
                                 dict(min_p=1.5), dict(logit_bias={1: 101}), dict(logit_bias={i: 1 for i in range(301)}),
                                 dict(logprobs=21), dict(prompt_logprobs=-1)])
def test_invalid_params_raise(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
