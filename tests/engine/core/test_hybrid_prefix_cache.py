"""The prefix cache on hybrid linear-attention models: a hit resumes the linear layers from a state checkpoint kept
under the KV block's own key. Scheduler tests (no model) force where checkpoints are taken, that an identical
prompt hits its last full block, that checkpoints stay within their rows; model tests compare greedy tokens with
transformers' on a tiny random Qwen3-Next, with chunked prefill (16 tokens a step), and assert the cached tokens."""

import dataclasses
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.request import Request
from engine.core.request_policy import RequestPolicy
from engine.core.scheduler import Scheduler
from engine.worker.cache_groups import kv_bytes_per_block
from engine.worker.model_setup import state_checkpoints_for_memory, state_slots_for_memory
from engine.worker.state_cache import state_bytes_per_slot
from tests.engine.helpers import complete, run_to_completion
from tests.engine.models.test_vs_transformers import hf_greedy
from tests.hf_models import make_hf_model

VOCAB = 211


def _scheduler(checkpoints: int, interval: int, num_blocks: int = 64, budget: int = 16) -> Scheduler:
    """Blocks of 4 tokens, 4 state slots and ``checkpoints`` checkpoint rows after them."""
    return Scheduler(SchedulerConfig(4, budget, 256),
                     CacheConfig(4, num_blocks, True, num_state_slots=4, num_state_checkpoints=checkpoints,
                                 state_checkpoint_interval=interval))


def _run(scheduler: Scheduler, rng: random.Random, prompts: list[list[int]], tag: str, salt: str | None = None):
    """Run the prompts (3 tokens each) to their end; the requests, and every plan's (loads, saves)."""
    reqs = [Request(f"{tag}{i}", p, SamplingParams(ignore_eos=True), max_tokens=3,
                    policy=RequestPolicy(cache_salt=salt)) for i, p in enumerate(prompts)]
    for r in reqs:
        scheduler.add_request(r)
    copies = []

    def check(out):
        scheduler.checkpoints.check_consistent()
        assert scheduler.checkpoints.num_held <= scheduler.checkpoints.num_checkpoints
        copies.append((out.state_loads, out.state_saves))
        rows = range(4, 4 + scheduler.checkpoints.num_checkpoints)
        assert all(a in rows and b < 4 for a, b in out.state_loads)  # checkpoint -> slot
        assert all(a < 4 and b in rows for a, b in out.state_saves)  # slot -> checkpoint

    run_to_completion(scheduler, rng, vocab=VOCAB, on_step=check)
    return reqs, copies


def test_identical_prompt_hits_its_last_full_block():
    """No interval checkpoint inside these prompts: the one at each prompt's last full block is what the repeat
    hits ((L - 1) // 4 blocks; a prompt of whole blocks too), and the prompt's chunks are cut there. The first
    prompt comes twice in one step (9-12 tokens: both chunks end at 8), so two saves of one key are planned
    before either is filed: one is kept, the other's row freed (``check_consistent`` every step)."""
    rng = random.Random(random.randrange(2**31))
    scheduler = _scheduler(checkpoints=8, interval=64)
    x = [rng.randrange(VOCAB) for _ in range(rng.randint(9, 12))]
    prompts = [x, x, [rng.randrange(VOCAB) for _ in range(28)]]
    _, copies = _run(scheduler, rng, prompts, "a")
    assert len(copies[0][1]) == 2 and sum(len(saves) for _, saves in copies) == 3
    assert scheduler.checkpoints.num_held == scheduler.checkpoints.num_saved == 2
    again, copies = _run(scheduler, rng, prompts, "b")
    assert [r.num_cached_tokens for r in again] == [8, 8, 24]
    assert sum(len(loads) for loads, _ in copies) == 3 and sum(len(saves) for _, saves in copies) == 0
    # Another tenant's salt: the same tokens find nothing.
    other, _ = _run(scheduler, rng, prompts, "c", salt="tenant-b")
    assert [r.num_cached_tokens for r in other] == [0, 0, 0]
    scheduler.states.check_all_free()
    scheduler.kv.pool.check_all_free()


def test_checkpoints_stay_within_their_rows_and_follow_lru():
    """Two rows for six prompts of 5 full blocks: never more than two held, the KV pool untouched by them, the
    last prompts' repeats hit (after 4 blocks: the interval's checkpoint, the prompt's last full one) and the
    first's finds its KV blocks cached but no checkpoint, so it hits nothing."""
    rng = random.Random(random.randrange(2**31))
    scheduler = _scheduler(checkpoints=2, interval=2)
    prompts = [[rng.randrange(VOCAB) for _ in range(21)] for _ in range(6)]
    for i, p in enumerate(prompts):  # one after another: each commits its checkpoints before the next starts
        _, copies = _run(scheduler, rng, [p], f"p{i}")
        # The first chunk (16 tokens) ends at 4 blocks, the interval's; the one after it is cut at 5 blocks.
        assert sum(len(saves) for _, saves in copies) == 2
    assert scheduler.checkpoints.num_held == 2 and scheduler.checkpoints.num_evicted >= 8
    first_blocks = scheduler.kv.pool.lookup(scheduler.kv.prefix_key(Request("q", prompts[0], SamplingParams(), 1), 5))
    assert first_blocks is not None, "the first prompt's KV stays cached: only its checkpoints were evicted"
    (last,), _ = _run(scheduler, rng, [prompts[-1]], "again")
    (first,), _ = _run(scheduler, rng, [prompts[0]], "first")
    assert (last.num_cached_tokens, first.num_cached_tokens) == (20, 0)
    scheduler.kv.pool.check_all_free()


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    """(checkpoint path, transformers model, seed, rng) of a tiny random Qwen3-Next, built once."""
    seed = random.randrange(2**31)
    path = str(tmp_path_factory.mktemp("qwen3_next"))
    return path, make_hf_model("qwen3_next", path, seed=seed, vocab_size=VOCAB), seed, random.Random(seed)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)


def _same_logprobs(hit, miss) -> bool:
    """A hit resumes from the very state the miss computed (the same chunks): its tokens' logprobs are the
    miss's, which catches a wrong state that a tiny random model's argmax happens to survive."""
    return hit.logprobs.logprobs == pytest.approx(miss.logprobs.logprobs, abs=1e-5)


def test_second_pass_over_a_shared_prefix_hits_and_matches_transformers(qwen3_next, caplog):
    """Prompts sharing 40 tokens, checkpoints every 2 blocks (32 tokens) and at each prompt's last full block,
    prefill chunked 16 tokens a step. The second pass repeats two prompts (hits at their last full blocks: 48 and
    64 tokens) and adds a third that shares only the prefix (hit at 32: the interval's checkpoint); every greedy
    token equals transformers'."""
    path, hf, seed, rng = qwen3_next
    shared = [rng.randrange(1, VOCAB - 1) for _ in range(40)]
    a, b, d = (shared + [rng.randrange(1, VOCAB - 1) for _ in range(n)] for n in (9, 25, 12))
    expected = {len(p): hf_greedy(hf, p, 6) for p in (a, b, d)}
    with caplog.at_level("INFO"):
        llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=32, block_size=16,
                  max_num_batched_tokens=16, state_checkpoint_interval=2)
    costs = [r.message for r in caplog.records if r.message.startswith("prefix cache: ")]
    num = llm.engine.scheduler.checkpoints.num_checkpoints
    assert len(costs) == 1 and costs[0].startswith(f"prefix cache: {num} state checkpoints of "), costs
    first = llm.generate([a, b], _greedy(6))
    assert [o.token_ids for o in first] == [expected[49], expected[65]], f"seed={seed}"
    second = llm.generate([a, b, d], _greedy(6))
    assert [o.token_ids for o in second] == [expected[49], expected[65], expected[52]], f"seed={seed}"
    assert [o.num_cached_tokens for o in second] == [48, 64, 32], f"seed={seed}"
    assert _same_logprobs(second[0], first[0]) and _same_logprobs(second[1], first[1]), f"seed={seed}"
    scheduler = llm.engine.scheduler
    scheduler.checkpoints.check_consistent()
    scheduler.states.check_all_free()
    scheduler.kv.pool.check_all_free()
    # The checkpoints' rows come out of the KV memory: at most their share of what they and the blocks hold.
    engine, per_slot = llm.engine, state_bytes_per_slot(llm.engine.model, torch.float32)
    per_block = kv_bytes_per_block(engine.model, 16, torch.float32)
    held = num * per_slot
    assert held <= 0.25 * (32 * per_block + held) and held + per_slot > 0.25 * (32 * per_block + held + per_slot)
    config = dataclasses.replace(engine.config, num_kv_blocks=None, kv_cache_memory_gb=400 * per_slot / 2**30,
                                 max_num_seqs=8)
    slots = state_slots_for_memory(config, engine.model, torch.device("cpu"), torch.float32)
    checkpoints = state_checkpoints_for_memory(config, engine.model, torch.device("cpu"), torch.float32, slots)
    assert (slots, checkpoints) == (8, 98)  # a quarter of the 400 - 8 slots' bytes the blocks and they share


def test_evicted_checkpoint_and_other_tenants_find_nothing(qwen3_next):
    """One checkpoint row: a second prompt's checkpoint takes the first's row, so the first prompt again (its KV
    blocks still cached) must hit nothing; a row read under a stale key would resume it from the other prompt's
    state and change its tokens. Another tenant's identical prompt hits nothing either; its owner's does. With
    overlapped steps (saves filed one step later; the sync path is the test above)."""
    path, hf, seed, rng = qwen3_next
    p1, p2 = ([rng.randrange(1, VOCAB - 1) for _ in range(40)] for _ in range(2))
    expected = [hf_greedy(hf, p, 5) for p in (p1, p2)]
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=16, block_size=16, max_num_batched_tokens=16,
              state_checkpoint_share=0.05, overlap_scheduling=True)
    engine = llm.engine
    assert engine.scheduler.checkpoints.num_checkpoints == 1
    runs = [(p1, "t1"), (p2, "t1"), (p1, "t1"), (p1, "t1"), (p1, "t2")]
    outs = [complete(engine, p, _greedy(5), RequestPolicy(cache_salt=salt)) for p, salt in runs]
    assert [o.token_ids for o in outs] == [expected[i] for i in (0, 1, 0, 0, 0)], f"seed={seed}"
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 32, 0], f"seed={seed}"
    assert all(_same_logprobs(o, outs[0]) for o in outs[2:]), f"seed={seed}"
    engine.scheduler.kv.pool.check_all_free()
