"""Logprobs (generated tokens, their top tokens, prompt tokens) equal a log-softmax of transformers' logits on the
same checkpoint, with chunked prefill and preemption, in batches mixing requests with and without logprobs."""

import random

import pytest
import torch

from engine import LLM, SamplingParams
from tests.hf_models import make_hf_model

VOCAB = 211
# 64 blocks of 16 hold every request of a test at once (at most 6 x 100 tokens): the pool sized from memory (2 GB,
# ~1.5 s to build per engine on the CPU) would compare nothing more.
ROOMY_POOL = 64
MODES = {"default": dict(num_kv_blocks=ROOMY_POOL),
         "chunked_prefill": dict(num_kv_blocks=ROOMY_POOL, max_num_batched_tokens=24),
         "preemption": dict(num_kv_blocks=8, block_size=16, max_num_batched_tokens=64)}  # 8 blocks: less than the requests admitted together need


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    seed = random.randrange(2**31)
    path = str(tmp_path_factory.mktemp("qwen3"))
    hf = make_hf_model("qwen3_moe", path, seed=seed, vocab_size=VOCAB)
    return path, hf, seed


def hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V] float64: row p is the log-softmax of transformers' logits after tokens[:p + 1]."""
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def check_position(ref_row: torch.Tensor, token: int, value: float, top_ids: list[int], top_values: list[float], k: int,
                   where: str = ""):
    """``where`` names the position in a failure (seed, request, position): a random model's rare case must be
    reproducible from CI's log."""
    ref_vals, ref_ids = ref_row.topk(k)
    context = (f"{where}: token {token} logprob {value}, reference {ref_row[token].item()}; top ours "
               f"{list(zip(top_ids, top_values))}, reference {list(zip(ref_ids.tolist(), ref_vals.tolist()))}")
    assert value == pytest.approx(ref_row[token].item(), abs=2e-4), context
    assert len(top_ids) == k == len(top_values), context
    assert top_values == pytest.approx(ref_vals.tolist(), abs=2e-4), context
    gaps = (ref_vals[:-1] - ref_vals[1:]).tolist() + [1.0]
    for i, (got, want) in enumerate(zip(top_ids, ref_ids.tolist())):
        if gaps[i] > 1e-3 and (i == 0 or gaps[i - 1] > 1e-3):  # a near-tie may come in either order
            assert got == want, context


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", list(MODES))
def test_logprobs_match_transformers(checkpoint, mode):
    path, hf, seed = checkpoint
    rng = random.Random(seed + len(mode))
    llm = LLM(model=path, dtype="float32", device="cpu", **MODES[mode])
    # Preemption: prompts of 17-32 tokens (2 blocks of 16) and 30-40 generated (3-5 blocks in all), so four
    # requests are admitted into the 8-block pool and the first to need a new block finds none: always preempts.
    prompt_range, longest = ((17, 32), (30, 40)) if mode == "preemption" else ((2, 80), (10, 20))
    prompts = [[rng.randrange(1, VOCAB - 1) for _ in range(rng.randint(*prompt_range))] for _ in range(6)]
    params = []
    for i in range(len(prompts)):
        params.append(SamplingParams(
            temperature=[0.0, 1.0][i % 2], seed=rng.randrange(1000), max_tokens=rng.randint(*longest), ignore_eos=True,
            logprobs=[None, 0, 3, 20][i % 4], prompt_logprobs=[None, 5, None, 0, 2, None][i]))
    outs = llm.generate(prompts, params)
    for index, (prompt, p, out) in enumerate(zip(prompts, params, outs)):
        ref = hf_logprobs(hf, prompt + out.token_ids)  # [P + G, V]
        if p.logprobs is None:
            assert out.logprobs is None
        else:
            lp = out.logprobs
            assert lp.token_ids == out.token_ids and len(lp.tokens) == len(out.token_ids)
            for g, token in enumerate(out.token_ids):
                row = ref[len(prompt) - 1 + g]  # the logits that chose token g
                check_position(row, token, lp.logprobs[g], lp.top_ids[g], lp.top_logprobs[g], p.logprobs,
                               f"seed={seed} mode={mode} request {index} generated {g}")
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        plp = out.prompt_logprobs
        assert plp.token_ids == prompt and plp.logprobs[0] is None
        for pos in range(1, len(prompt)):
            check_position(ref[pos - 1], prompt[pos], plp.logprobs[pos], plp.top_ids[pos], plp.top_logprobs[pos],
                           p.prompt_logprobs, f"seed={seed} mode={mode} request {index} prompt {pos}")
    if mode == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    else:
        assert llm.engine.scheduler.num_preemptions == 0, f"seed={seed}: the roomy pool should hold every request"


@pytest.mark.timeout(120)
def test_prompt_logprobs_skip_the_prefix_cache(checkpoint):
    """A prompt whose blocks are cached is still scored at every position."""
    path, hf, seed = checkpoint
    rng = random.Random(seed)
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=16, num_kv_blocks=ROOMY_POOL)
    prompt = [rng.randrange(1, VOCAB - 1) for _ in range(70)]
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # caches its blocks
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1))[0]
    ref = hf_logprobs(hf, prompt)
    assert out.prompt_logprobs.token_ids == prompt
    assert out.prompt_logprobs.logprobs[1:] == pytest.approx([ref[p - 1, prompt[p]].item() for p in range(1, 70)],
                                                             abs=2e-4)


@pytest.mark.timeout(120)
def test_every_choice_of_n_has_its_logprobs(checkpoint):
    """n > 1: each choice carries the logprobs of its own generated tokens and of the prompt (the copies share the
    prompt's prefill but are scored under their own request ids)."""
    path, hf, seed = checkpoint
    rng = random.Random(seed + 1)
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=16, num_kv_blocks=ROOMY_POOL)
    prompt = [rng.randrange(1, VOCAB - 1) for _ in range(rng.randint(3, 40))]
    params = SamplingParams(n=3, temperature=1.0, seed=rng.randrange(1000), max_tokens=rng.randint(4, 9),
                            ignore_eos=True, logprobs=2, prompt_logprobs=1)
    outs = llm.generate([prompt], params)
    assert [o.index for o in outs] == [0, 1, 2]
    for out in outs:
        ref = hf_logprobs(hf, prompt + out.token_ids)  # [P + G, V]
        assert out.logprobs is not None and out.logprobs.token_ids == out.token_ids
        for g, token in enumerate(out.token_ids):
            lp = out.logprobs
            check_position(ref[len(prompt) - 1 + g], token, lp.logprobs[g], lp.top_ids[g], lp.top_logprobs[g], 2)
        assert out.prompt_logprobs is not None and out.prompt_logprobs.token_ids == prompt
        assert out.prompt_logprobs.logprobs[1:] == pytest.approx(
            [ref[p - 1, prompt[p]].item() for p in range(1, len(prompt))], abs=2e-4)
