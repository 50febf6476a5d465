"""Speculative decoding with a draft model: greedy output equal to transformers' and to decoding without
speculation, under preemption and prefix-cache hits; a draft that is the model itself has every draft accepted
(its KV cache follows the verified tokens exactly); every KV block returns to the pool."""

import copy
import random

import pytest

from engine import LLM, SamplingParams
from tests.engine.core.test_speculative import VOCAB, drive, make_prompts
from tests.engine.models.test_vs_transformers import hf_greedy
from tests.hf_models import make_hf_model

SEED = random.randrange(2**31)  # fresh weights and prompts each run; every message names the seed
# Four 17-32-token prompts generating 30-40 tokens each need more than the 8-block pool: it always preempts.
PREEMPTING = dict(num_kv_blocks=8, block_size=16, max_num_batched_tokens=64, overlap_scheduling=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The target (2 layers), a smaller draft (its first layer only: it agrees on some tokens) and prompts with
    their greedy outputs."""
    target = str(tmp_path_factory.mktemp("target"))
    hf = make_hf_model("qwen3_moe", target, seed=SEED, vocab_size=VOCAB)
    small = str(tmp_path_factory.mktemp("draft"))
    truncated = copy.deepcopy(hf)
    truncated.model.layers = truncated.model.layers[:1]
    truncated.config.num_hidden_layers = 1
    truncated.save_pretrained(small)
    rng = random.Random(SEED)
    max_tokens = [rng.randint(30, 40) for _ in range(6)]
    prompts = [p[:rng.randint(17, 32)] for p in make_prompts(rng, 6)]
    prompts = [(p * 2)[:17] if len(p) < 17 else p for p in prompts]
    expected = [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens)]
    return target, small, prompts, max_tokens, expected


def spec_llm(target: str, draft: str, **kw) -> LLM:
    return LLM(model=target, dtype="float32", device="cpu", speculative="draft", speculative_model=draft,
               num_speculative_tokens=3, speculative_max_batch=64, speculative_min_acceptance=0.0, **kw)


@pytest.mark.parametrize("which", ["itself", "small"])
def test_greedy_matches_transformers_under_preemption(models, which):
    target, small, prompts, max_tokens, expected = models
    llm = spec_llm(target, target if which == "itself" else small, **PREEMPTING)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    got, outs, ended_in_run = drive(llm, prompts, params)
    for prompt, tokens, out, ref in zip(prompts, got, outs, expected):
        assert tokens == ref, f"seed={SEED} draft={which} prompt_len={len(prompt)}"
        assert out.finish_reason == "length" and out.num_output_tokens == len(ref)
    stats = llm.engine.stats()
    assert llm.engine.scheduler.num_preemptions > 0, "the small KV pool should have forced preemption"
    if which == "itself":  # the draft's KV follows the verified tokens: it proposes what the model samples
        assert ended_in_run > 0, f"seed={SEED}: no max_tokens fell inside an accepted run"
        assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens == stats.spec_draft_tokens, \
            (SEED, stats.spec_accepted_tokens, stats.spec_draft_tokens)
    else:  # the truncated random draft is rejected (some seeds' drafts agree on no token at all: 0 of 517 once),
        # so verification rolls its drafts back; full acceptance is the case above
        assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens < stats.spec_draft_tokens, \
            (SEED, stats.spec_accepted_tokens, stats.spec_draft_tokens)
    llm.engine.scheduler.kv.pool.check_all_free()
    llm.engine.step()  # hands the runner the ids that finished in the last step
    assert not llm.engine.runner.draft.computed, "finished requests are forgotten"


def test_prefix_cache_hits_and_seeded_sampling(models):
    """Second round: every prompt starts on cached blocks (their draft K/V written by another request, or
    never) and the model-as-draft still has every draft accepted; seeded sampling equals plain decoding's."""
    target, small, prompts, max_tokens, _ = models
    plain = LLM(model=target, dtype="float32", device="cpu", num_kv_blocks=64)
    itself = spec_llm(target, target, num_kv_blocks=64)
    greedy = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    want = drive(plain, prompts, greedy)[0]
    assert drive(itself, prompts, greedy)[0] == want, f"seed={SEED}"
    # Prompts extended by their outputs: hits cover the prompts' blocks, computed while drafts were being verified.
    longer = [p + w for p, w in zip(prompts, want)]
    hits_before = itself.engine.scheduler.kv.prefix_hit_tokens
    assert drive(itself, longer, greedy)[0] == drive(plain, longer, greedy)[0], f"seed={SEED}"
    assert itself.engine.scheduler.kv.prefix_hit_tokens > hits_before, f"seed={SEED}: no prefix-cache hit"
    stats = itself.engine.stats()
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0, (SEED, stats)
    seeded = [SamplingParams(temperature=0.8, seed=SEED + i, max_tokens=30, ignore_eos=True) for i in range(len(prompts))]
    small_llm = spec_llm(target, small, num_kv_blocks=64)
    assert drive(small_llm, prompts, seeded)[0] == drive(plain, prompts, seeded)[0], f"seed={SEED}"
    for llm in (itself, small_llm):
        llm.engine.scheduler.kv.pool.check_all_free()


def test_draft_settings_are_checked(models, tmp_path):
    from engine.core.config import EngineConfig

    for bad in (dict(speculative="draft"), dict(speculative="ngram", speculative_model="d"),
                dict(speculative="draft", speculative_model="d", tensor_parallel_size=2)):
        with pytest.raises(ValueError, match="speculative"):
            EngineConfig(model="m", **bad)
    other = str(tmp_path / "other_vocab")
    make_hf_model("qwen3_moe", other, seed=SEED, vocab_size=VOCAB + 2, num_layers=1)
    with pytest.raises(ValueError, match="speculative_model .* vocabulary of 213 tokens, the model 211"):
        spec_llm(models[0], other)
    with pytest.raises(ValueError, match="speculative_model: .*missing.*not a directory"):
        spec_llm(models[0], str(tmp_path / "missing"))
