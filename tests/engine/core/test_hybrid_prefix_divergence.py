"""Hybrid models' prefix cache where requests share a system prompt shorter than the checkpoint interval: the
state is checkpointed where a request's KV hit ends (the prompts diverge there), and a request arriving while
that checkpoint is being taken waits for it. Without that, no request behind such a prompt would hit at all.
A scheduler test (no model) and a model test comparing greedy tokens with transformers' (tiny random
Qwen3.5-MoE)."""

import random

from engine import LLM, SamplingParams
from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from tests.engine.helpers import run_to_completion
from tests.engine.models.test_vs_transformers import hf_greedy
from tests.hf_models import make_hf_model

VOCAB = 211


def _prompts(rng: random.Random, shared_len: int, suffix_lens: list[int]) -> list[list[int]]:
    """One shared prefix of ``shared_len`` tokens, each prompt's own suffix after it (first tokens all different,
    so they diverge right after the prefix)."""
    shared = [rng.randrange(1, VOCAB - 1) for _ in range(shared_len)]
    firsts = rng.sample(range(1, VOCAB - 1), len(suffix_lens))
    return [shared + [f] + [rng.randrange(1, VOCAB - 1) for _ in range(n - 1)] for f, n in zip(firsts, suffix_lens)]


def test_checkpoint_at_the_divergence_and_waiting_for_it():
    """Blocks of 4, interval 64 blocks (never reached). A alone; then B and C in one step: both find A's KV
    blocks of the prefix but no checkpoint; B computes its prompt from the start, cut where its hit ended, and
    checkpoints there; C waits for that checkpoint instead of computing the prefix too; D later hits it."""
    rng = random.Random(random.randrange(2**31))
    shared_len = rng.randint(17, 30)
    a, b, c, d = _prompts(rng, shared_len, [rng.randint(3, 9) for _ in range(4)])
    scheduler = Scheduler(SchedulerConfig(4, 256, 256),
                          CacheConfig(4, 64, True, num_state_slots=4, num_state_checkpoints=8,
                                      state_checkpoint_interval=64))
    cached = {}
    for tag, prompts in (("a", [a]), ("b", [b, c]), ("d", [d])):
        reqs = [Request(f"{tag}{i}", p, SamplingParams(ignore_eos=True), max_tokens=3) for i, p in enumerate(prompts)]
        for r in reqs:
            scheduler.add_request(r)
        run_to_completion(scheduler, rng, vocab=VOCAB, on_step=lambda out: scheduler.checkpoints.check_consistent())
        cached.update({r.request_id: r.num_cached_tokens for r in reqs})
    hit = shared_len // 4 * 4
    # A's prompt is checkpointed at its last full block before its last token too: where that is the prefix's
    # last full block (a short suffix), B finds that checkpoint and hits at once.
    b_hit = hit if (len(a) - 1) // 4 * 4 == hit else 0
    assert cached == {"a0": 0, "b0": b_hit, "b1": hit, "d0": hit}, (shared_len, len(a))
    scheduler.states.check_all_free()
    scheduler.kv.pool.check_all_free()


def test_requests_behind_a_short_system_prompt_hit_and_match_transformers(tmp_path):
    """A shared prefix of 40-60 tokens (blocks of 16; the default interval, 64 blocks, never reached), chunks of
    up to 2048 tokens: the first request computes everything, the next two (one step) find its KV but no
    checkpoint, one of them checkpoints at the prefix's last full block and the other waits for it; a fourth hits
    it too. Every greedy token equals transformers'; with overlapped steps (checkpoints filed a step later)."""
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    hf = make_hf_model("qwen3_5_moe", str(tmp_path), seed=seed, vocab_size=VOCAB)
    shared_len = rng.randint(40, 60)
    prompts = _prompts(rng, shared_len, [rng.randint(5, 20) for _ in range(4)])
    expected = [hf_greedy(hf, p, 4) for p in prompts]
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=32, block_size=16,
              overlap_scheduling=True)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(prompts[:1], params) + llm.generate(prompts[1:3], params) + llm.generate(prompts[3:], params)
    assert [o.token_ids for o in outs] == expected, f"seed={seed}"
    hit = shared_len // 16 * 16
    second = hit if (len(prompts[0]) - 1) // 16 * 16 == hit else 0  # its checkpoint at the prefix's last block
    assert [o.num_cached_tokens for o in outs] == [0, second, hit, hit], f"seed={seed}"
    scheduler = llm.engine.scheduler
    scheduler.checkpoints.check_consistent()
    scheduler.states.check_all_free()
    scheduler.kv.pool.check_all_free()
