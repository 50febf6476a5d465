"""Sampling: seeds are per request, filters restrict the support, stop conditions end requests."""

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.request import Request
from engine.sampling.sampler import Sampler
from tests.hf_models import make_hf_model
from tests.devices import DEVICES


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("olmoe"))
    make_hf_model("olmoe", path, seed=random.randrange(2**31), initializer_range=0.02)
    # 64 blocks of 16 hold every test's requests at once (at most 4 of 110 tokens, or 6 of 55), where the pool sized
    # from memory (2 GB) takes ~1.5 s to build on the CPU.
    return LLM(model=path, max_num_batched_tokens=64, num_kv_blocks=64)


def _prompt(rng, n):
    return [rng.randrange(1, 200) for _ in range(n)]


def test_same_seed_same_output_whatever_the_batch(llm):
    rng = random.Random()
    target = _prompt(rng, 9)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate([target], seeded)[0].token_ids
    others = [_prompt(rng, rng.randint(2, 30)) for _ in range(5)]
    crowd = llm.generate(others[:3] + [target] + others[3:], [SamplingParams(temperature=1.0, max_tokens=25, ignore_eos=True)] * 3 + [seeded] + [SamplingParams(temperature=0.7, max_tokens=5, ignore_eos=True)] * 2)
    assert crowd[3].token_ids == alone
    other_seed = llm.generate([target], SamplingParams(temperature=1.0, seed=99, max_tokens=20, ignore_eos=True))[0]
    assert other_seed.token_ids != alone  # 20 draws from a ~flat distribution over 211 tokens


def test_top_k_1_is_greedy_and_stop_token_ids(llm):
    rng = random.Random()
    prompt = _prompt(rng, 12)
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    topk1 = llm.generate([prompt], SamplingParams(temperature=2.0, top_k=1, max_tokens=10, ignore_eos=True))[0]
    assert topk1.token_ids == greedy.token_ids
    stop_tok = greedy.token_ids[4]
    first = greedy.token_ids.index(stop_tok)
    # ignore_eos as in the greedy run: the random model may emit EOS before stop_tok (that stop is not under test).
    stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_tok],
                                                    ignore_eos=True))[0]
    assert stopped.token_ids == greedy.token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_tok


def _requests(params_list):
    return [Request(str(i), [1], p, max_tokens=10) for i, p in enumerate(params_list)]


@pytest.mark.parametrize("device", DEVICES)
def test_sampler_filters_and_distribution(device):
    torch.manual_seed(0)
    sampler = Sampler(torch.device(device), seed=random.randrange(2**31))
    logits = torch.randn(1, 50, device=device)
    n = 4000
    reqs = _requests([SamplingParams(temperature=1.0)] * n)
    counts = torch.bincount(torch.tensor(sampler(logits.repeat(n, 1), reqs).token_ids), minlength=50).double()
    probs = torch.softmax(logits[0].double().cpu(), -1)
    # Every token's frequency within 5 standard errors of its probability.
    se = (probs * (1 - probs) / n).sqrt()
    assert ((counts / n - probs).abs() <= 5 * se + 1e-3).all()

    top5 = set(logits[0].cpu().topk(5).indices.tolist())
    got = sampler(logits.repeat(300, 1), _requests([SamplingParams(temperature=1.0, top_k=5)] * 300)).token_ids
    assert set(got) <= top5 and len(set(got)) > 1

    sorted_p, idx = probs.sort(descending=True)
    nucleus = set(idx[: int((sorted_p.cumsum(0) < 0.5).sum()) + 1].tolist())
    got = sampler(logits.repeat(300, 1), _requests([SamplingParams(temperature=1.0, top_p=0.5)] * 300)).token_ids
    assert set(got) <= nucleus


def test_min_tokens_suppresses_eos():
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.zeros(1, 8)
    logits[0, 3] = 100.0  # EOS overwhelmingly likely
    (req,) = _requests([SamplingParams(temperature=0, min_tokens=2)])
    req.eos_token_id = 3
    assert sampler(logits.clone(), [req]).token_ids != [3]


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(max_tokens=0), dict(stop=[""]), dict(n=0), dict(n=129), dict(stop_token_ids=[-1])])
def test_invalid_params_raise(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_engine_abort_mid_generation_frees_blocks(llm):
    rng = random.Random()
    engine = llm.engine
    ids = [engine.add_request(_prompt(rng, rng.randint(5, 60)), SamplingParams(max_tokens=50, ignore_eos=True)) for _ in range(4)]
    tokens = {}
    for _ in range(3):
        for out in engine.step():
            tokens[out.request_id] = tokens.get(out.request_id, 0) + len(out.token_ids)
    aborted = engine.abort(ids[1])
    assert aborted is not None and aborted.finished and aborted.finish_reason == "abort"
    assert engine.abort("no-such-request") is None
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] = tokens.get(out.request_id, 0) + len(out.token_ids)
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {ids[0], ids[2], ids[3]}
    assert all(o.num_output_tokens == 50 for o in finished.values())
    assert {rid: tokens[rid] for rid in finished} == {rid: 50 for rid in finished}  # every step's tokens, once
    engine.scheduler.kv.pool.check_all_free()
