"""Speculative decoding's pieces without a model: prompt lookup against a brute-force search, the accepted
prefix, rejection sampling's distribution against exact float64 probabilities, switching off, and the KV
blocks of rejected drafts going back to the pool."""

import random

import pytest
import torch

from engine.core.block_pool import hash_block_tokens
from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.speculation import (
    PROBE_EVERY, SpeculativeConfig, Speculator, accepted_prefix, ngram_proposal,
)
from engine.sampling.sampler import Sampler


def _brute_ngram(tokens: list[int], k: int) -> list[int]:
    for n in (3, 2):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == suffix]
        if starts:
            return tokens[starts[-1] + n:starts[-1] + n + k]
    return []


def test_ngram_proposal_matches_brute_force():
    rng = random.Random()
    for _ in range(500):
        tokens = [rng.randrange(rng.choice([2, 4, 30])) for _ in range(rng.randint(1, 60))]
        k = rng.randint(1, 6)
        assert ngram_proposal(tokens, k) == _brute_ngram(tokens, k), tokens


def test_accepted_prefix():
    assert accepted_prefix([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all kept, plus the bonus token
    assert accepted_prefix([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the model's token at the first miss ends it
    assert accepted_prefix([5], [4, 1]) == [4]


def _exact_two_tokens(table: torch.Tensor, first: int, temperature: float) -> torch.Tensor:
    # P(t1, t2 | context ending in `first`) [V, V] in float64, for a "model" whose next-token logits depend on
    # the previous token only (row `prev` of table [V, V]).
    probs = torch.softmax(table.double() / temperature, dim=-1)  # [V, V]
    return probs[first][:, None] * probs  # [V, V]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rejection_sampling_keeps_the_target_distribution(temperature):
    """The first two tokens emitted with 2 point-mass drafts, sampled over many independent requests at once,
    follow the target distribution; the same count of plain draws is the yardstick for the noise."""
    vocab, n = 8, 20000
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    table = torch.randn(vocab, vocab) * 1.5  # [V, V] logits of the next token given the previous one
    first = random.randrange(vocab)
    # Drafts: a likely and an unlikely token, so both acceptance and rejection happen often.
    p0 = torch.softmax(table[first] / temperature, dim=-1)
    d0 = int(p0.argmax())
    d1 = int(torch.softmax(table[d0] / temperature, dim=-1).argmin())
    sampler = Sampler(torch.device("cpu"), seed)
    params = SamplingParams(temperature=temperature)
    requests = [Request(str(i), [first], params, max_tokens=8) for i in range(n)]
    rows = [r for r in requests for _ in range(3)]
    logits = torch.stack([table[first], table[d0], table[d1]]).repeat(n, 1)  # [3n, V]
    sampled = sampler(logits, rows, [0, 1, 2] * n).token_ids
    pairs = []
    second_needed = []
    for i in range(n):
        emitted = accepted_prefix([d0, d1], sampled[3 * i:3 * i + 3])
        pairs.append(emitted[:2])
        if len(emitted) == 1:
            second_needed.append(i)
    # Requests that emitted one token draw their second one the plain way, from that token's row.
    nxt = sampler(table[[pairs[i][0] for i in second_needed]].clone(), [requests[i] for i in second_needed]).token_ids
    for i, t in zip(second_needed, nxt):
        pairs[i].append(t)
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    for a, b in pairs:
        counts[a, b] += 1
    exact = _exact_two_tokens(table, first, temperature)
    tv = 0.5 * (counts / n - exact).abs().sum().item()
    # Plain decoding's own draws of the same size, for the scale of sampling noise.
    plain_first = sampler(table[[first] * n].clone(), requests).token_ids
    plain_second = sampler(table[plain_first].clone(), requests).token_ids
    plain = torch.zeros(vocab, vocab, dtype=torch.float64)
    for a, b in zip(plain_first, plain_second):
        plain[a, b] += 1
    tv_plain = 0.5 * (plain / n - exact).abs().sum().item()
    assert tv < max(0.03, 2 * tv_plain), f"seed={seed}: TV {tv:.4f} (plain sampler's own: {tv_plain:.4f})"
    # The test can fail: always keeping the drafts would be far off.
    wrong = torch.zeros(vocab, vocab, dtype=torch.float64)
    wrong[d0, d1] = 1.0
    assert 0.5 * (wrong - exact).abs().sum().item() > 0.1


def test_seeded_rows_draw_by_position():
    """A seeded request's token at position p is the same drawn alone or as row p of a speculative step."""
    vocab = 16
    logits = torch.randn(4, vocab)
    sampler = Sampler(torch.device("cpu"), 0)
    request = Request("a", [1, 2, 3], SamplingParams(temperature=1.0, seed=random.randrange(2**31)), max_tokens=9)
    together = sampler(logits.clone(), [request] * 4, [0, 1, 2, 3]).token_ids
    alone = []
    for j in range(4):
        alone.append(sampler(logits[j:j + 1].clone(), [request]).token_ids[0])
        request.append_output_token(0)  # the next row's position
    assert together == alone


def _hash_chain(tokens: list[int], num_blocks: int, block_size: int = 4) -> list[bytes]:
    hashes: list[bytes] = []
    for i in range(num_blocks):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens[i * block_size:(i + 1) * block_size], None))
    return hashes


def _spec_scheduler(num_blocks: int, max_batch: int = 8) -> Scheduler:
    spec = Speculator(SpeculativeConfig("ngram", 3, max_batch, 0.3), max_model_len=512)
    return Scheduler(SchedulerConfig(8, 64, 512), CacheConfig(4, num_blocks, True), speculator=spec)


def test_rejected_drafts_blocks_return_and_nothing_leaks():
    """Random acceptance over looping requests with a pool that forces preemption: after each step every
    running request holds just the blocks its tokens need, and the pool is whole at the end."""
    rng = random.Random()
    scheduler = _spec_scheduler(num_blocks=24)
    for i in range(6):
        pattern = [rng.randrange(3) for _ in range(rng.randint(1, 4))]
        scheduler.add_request(Request(f"r{i}", pattern * 6, SamplingParams(ignore_eos=True), max_tokens=rng.randint(30, 40)))
    steps = drafted = 0
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        sampled = []
        for s in plan.scheduled:
            if s.draft_token_ids:  # accept a random prefix of the drafts
                drafted += 1
                keep = rng.randint(0, len(s.draft_token_ids))
                sampled.append(s.draft_token_ids[:keep] + [rng.randrange(3) for _ in range(len(s.draft_token_ids) + 1 - keep)])
            else:
                sampled.append(rng.randrange(3) if s.sample else None)
        scheduler.update(plan, sampled)
        for r in scheduler.running:  # registered prefix hashes are those of the request's real tokens
            assert scheduler.kv._hashes.get(r.request_id, []) == _hash_chain(r.all_token_ids, len(scheduler.kv._hashes.get(r.request_id, [])))
        for s in plan.scheduled:  # a speculating request keeps the blocks of its verified tokens and the next one
            r = s.request
            if s.draft_token_ids and not r.is_finished:
                held = len(scheduler.kv.block_ids(r.request_id))
                assert -(-r.num_computed_tokens // 4) <= held <= -(-r.num_tokens // 4)
                assert r.num_computed_tokens == r.num_tokens - 1
        if steps == 10:
            scheduler.abort(scheduler.running[0].request_id)
        steps += 1
        assert steps < 1000
    assert drafted > 0 and scheduler.num_preemptions > 0, (drafted, scheduler.num_preemptions)
    scheduler.kv.pool.check_all_free()


def test_speculation_switches_off_in_large_batches_and_at_low_acceptance():
    spec = Speculator(SpeculativeConfig("ngram", 3, 2, 0.5), max_model_len=512)
    request = Request("a", [1, 2, 3] * 5, SamplingParams(), max_tokens=100)
    assert spec.propose(request, num_running=2) == [1, 2, 3]
    assert spec.propose(request, num_running=3) == []  # more running than max_batch
    spec.record(request, 3, 0)
    spec.record(request, 3, 0)  # the moving average falls below 0.5
    proposals = [spec.propose(request, 1) for _ in range(PROBE_EVERY)]
    assert proposals[:-1] == [[]] * (PROBE_EVERY - 1) and proposals[-1] == [1, 2, 3]  # then it probes
    # No proposals where the request's sampling needs each step's own state.
    for params in (SamplingParams(logprobs=1), SamplingParams(presence_penalty=0.5), SamplingParams(min_tokens=3)):
        assert spec.propose(Request("b", [1, 2, 3] * 5, params, max_tokens=100), 1) == []
    # Drafts never run past max_tokens: a step emits at most max_tokens - generated tokens.
    short = Request("c", [1, 2, 3] * 5, SamplingParams(), max_tokens=3)
    assert spec.propose(short, 1) == [1, 2]
