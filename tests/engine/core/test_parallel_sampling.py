"""n > 1: copies of a prompt share one prefill and generate what n separate requests would."""

import random

import pytest

from engine import LLM, SamplingParams
from engine.core.parallel_sampling import choice_seed
from tests.hf_models import make_hf_model

BLOCK = 8
# 64 blocks of 8 hold every request of a test at once (at most 4 copies of 79 tokens), where the pool sized from
# memory (2 GB, ~1.5 s to build per engine on the CPU) holds nothing more that these tests look at.
ROOMY_POOL = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen2moe"))
    make_hf_model("qwen2_moe", path, seed=random.randrange(2**31))
    return path


def _greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)


@pytest.mark.timeout(120)
def test_copies_share_one_prefill(model_dir):
    rng = random.Random()
    prompt = [rng.randrange(1, 200) for _ in range(rng.randint(3 * BLOCK + 1, 5 * BLOCK - 1))]
    llm = LLM(model=model_dir, block_size=BLOCK, num_kv_blocks=ROOMY_POOL)
    (single,) = llm.generate([prompt], _greedy(5))
    before = llm.engine.stats().total_prefill_tokens
    outs = llm.generate([prompt, [7, 8, 9]], [_greedy(5, n=4), _greedy(3)])
    assert [o.index for o in outs] == [0, 1, 2, 3, 0]
    assert all(o.token_ids == single.token_ids for o in outs[:4])  # greedy: every copy is the n=1 answer
    # Fresh engine state for the prompt (its blocks were cached by the first run): count on a new engine.
    llm = LLM(model=model_dir, block_size=BLOCK, num_kv_blocks=ROOMY_POOL)
    outs = llm.generate([prompt], _greedy(5, n=4))
    prefill = llm.engine.stats().total_prefill_tokens
    tail = len(prompt) - (len(prompt) - 1) // BLOCK * BLOCK  # what a copy computes past the shared blocks
    assert prefill <= len(prompt) + 3 * tail, (prefill, len(prompt), before)
    assert prefill < 2 * len(prompt)
    assert [o.num_cached_tokens for o in outs[1:]] == [len(prompt) - tail] * 3
    llm.engine.scheduler.kv.pool.check_all_free()


@pytest.mark.timeout(120)
def test_copies_under_preemption_equal_single_requests(model_dir):
    rng = random.Random()
    prompts = [[rng.randrange(1, 200) for _ in range(rng.randint(10, 30))] for _ in range(3)]
    reference = LLM(model=model_dir, block_size=BLOCK, num_kv_blocks=ROOMY_POOL).generate(prompts, _greedy(12))
    # 12 blocks of 8 tokens cannot hold 3 x 3 sequences of up to 42 tokens: copies preempt each other.
    llm = LLM(model=model_dir, block_size=BLOCK, num_kv_blocks=12, max_num_seqs=8)
    outs = llm.generate(prompts, _greedy(12, n=3))
    assert llm.engine.scheduler.num_preemptions > 0
    for p, ref in enumerate(reference):
        assert [o.token_ids for o in outs[3 * p:3 * p + 3]] == [ref.token_ids] * 3
    llm.engine.scheduler.kv.pool.check_all_free()


@pytest.mark.timeout(120)
def test_seeded_copies_are_reproducible(model_dir):
    rng = random.Random()
    prompt = [rng.randrange(1, 200) for _ in range(20)]
    seed = rng.randrange(2**40)
    llm = LLM(model=model_dir, block_size=BLOCK, num_kv_blocks=ROOMY_POOL)
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, n=3, seed=seed)
    first = llm.generate([prompt], params)
    again = llm.generate([prompt, prompt[:7]], [params, SamplingParams(max_tokens=4)])[:3]
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    # Choice i is the single request with choice i's seed.
    for i, out in enumerate(first):
        (alone,) = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True,
                                                         seed=choice_seed(seed, i)))
        assert alone.token_ids == out.token_ids
    assert len({tuple(o.token_ids) for o in first}) > 1  # distinct seeds: 3 equal 8-token draws would be a bug


@pytest.mark.timeout(120)
def test_abort_ends_every_copy(model_dir):
    llm = LLM(model=model_dir, block_size=BLOCK, num_kv_blocks=ROOMY_POOL)
    engine = llm.engine
    rid = engine.add_request(list(range(1, 30)), _greedy(50, n=4))
    engine.step()  # the leader's prefill; the copies join the queue
    engine.step()
    assert engine.scheduler.num_running == 4
    engine.abort(rid)
    assert not engine.has_unfinished() and rid not in engine.choice_groups
    engine.scheduler.kv.pool.check_all_free()
    rid = engine.add_request(list(range(1, 30)), _greedy(50, n=4))
    engine.abort(rid)  # before any step: the held copies never reach the scheduler
    assert not engine.has_unfinished()
