"""Sliding-window models keep their prefix-cache hits with overlapped steps.

With steps overlapped, a request's computed count already covers the step in flight when the next step is
scheduled, and its window hands back sliding blocks that step computed before their tokens are read (which is
when blocks are registered in the prefix cache). Those blocks must still be cached: a later prompt sharing the
prefix needs the window's blocks of the sliding group to hit at all. Greedy tokens with overlap on equal those
with overlap off (the synchronous loop), and both hit the shared prefix. Torch attention on the CPU, tiny models.
"""

import random

import pytest

from engine import LLM, KernelChoice, SamplingParams
from tests.engine.models.test_step3p7 import make_step_model
from tests.hf_models import make_hf_model

VOCAB = 97
ENGINE = dict(kernel_choice=KernelChoice(attention="torch"), dtype="float32", device="cpu", num_kv_blocks=96,
              block_size=4, max_num_batched_tokens=24)


def _make(family: str, path: str, seed: int) -> None:
    if family == "step3p7":
        make_step_model(path, seed, vocab_size=VOCAB)
    else:
        make_hf_model(family, path, seed=seed, vocab_size=VOCAB)


# gpt-oss: a window of 8 on its first layer; Step-3.7-Flash: a sliding layer of window 8. Both keep the sliding
# layer's blocks in a cache group of their own, released as the window passes them.
@pytest.mark.parametrize("family", ["gpt_oss", "step3p7"])
def test_overlapped_steps_keep_the_prefix_hits_of_windowed_models(family, tmp_path):
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    _make(family, str(tmp_path), seed)
    shared = [rng.randrange(1, VOCAB - 1) for _ in range(13)]  # past the window: blocks 0-1 leave it
    prompts = [shared + [rng.randrange(1, VOCAB - 1) for _ in range(n)] for n in (3, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    tokens, hits = {}, {}
    for overlap in (False, True):
        llm = LLM(model=str(tmp_path), overlap_scheduling=overlap, **ENGINE)
        assert llm.engine.scheduler.kv.windows == (None, 8)
        # The first prompt alone (its blocks cached, its window's released), then the second, which shares them.
        outs = llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params)
        tokens[overlap] = [out.token_ids for out in outs]
        hits[overlap] = llm.engine.scheduler.kv.prefix_hit_tokens
        llm.engine.scheduler.kv.pool.check_all_free()
    assert tokens[True] == tokens[False], f"seed={seed}"
    # The 16-token first prompt fills 3 blocks the 22-token second one shares (13 tokens: 3 whole blocks).
    assert hits == {False: 12, True: 12}, f"seed={seed}: prefix hit tokens {hits}"
