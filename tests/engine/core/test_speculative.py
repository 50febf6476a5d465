"""Speculative decoding (n-gram) end to end: the same tokens as decoding one token a step, greedy (against
transformers and our own engine with speculation off) and seeded; stops cut where they would without it; every
KV block returns to the pool after finishing, preemption and aborts."""

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.loading.demo_model import write_demo_model
from tests.engine.models.test_vs_transformers import MODES, hf_greedy
from tests.hf_models import make_hf_model
from tests.devices import DEVICES

SEED = random.randrange(2**31)  # fresh weights and prompts each run; every message names the seed
VOCAB = 211
SPEC = dict(speculative="ngram", num_speculative_tokens=4, speculative_max_batch=64)


def make_prompts(rng: random.Random, n: int = 6) -> list[list[int]]:
    """Half repeat a short pattern (prompt lookup proposes from the first step), half are random."""
    prompts = []
    for i in range(n):
        if i % 2:
            prompts.append([rng.randrange(1, VOCAB - 1) for _ in range(rng.randint(3, 120))])
        else:
            pattern = [rng.randrange(1, VOCAB - 1) for _ in range(rng.randint(2, 6))]
            prompts.append((pattern * 40)[:rng.randint(12, 100)])
    return prompts


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("spec"))
    hf = make_hf_model("qwen3_moe", path, seed=SEED, vocab_size=VOCAB)
    rng = random.Random(SEED)
    max_tokens = [rng.randint(10, 50) for _ in range(8)]
    # Each prompt with the first 16 tokens of its greedy output: the rest repeats the context (looping).
    prompts, expected = [], []
    for prompt, m in zip(make_prompts(rng, 8), max_tokens):
        out = hf_greedy(hf, prompt, 16 + m)
        prompts.append(prompt + out[:16])
        expected.append(out[16:])
    return path, prompts, max_tokens, expected


def drive(llm: LLM, prompts, params, chunks: list | None = None) -> tuple[list[list[int]], list, int]:
    """Run to completion step by step: each request's tokens, its last output, and how many requests ended in
    a step that emitted several of their tokens (a stop or max_tokens inside an accepted run). ``chunks``, if
    given, receives each request's tokens step by step."""
    engine = llm.engine
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    steps: dict[str, list[list[int]]] = {i: [] for i in ids}
    last: dict[str, object] = {}
    ended_in_run = 0
    while engine.has_unfinished():
        for out in engine.step():
            steps[out.request_id].append(out.token_ids)
            last[out.request_id] = out
            ended_in_run += out.finished and len(out.token_ids) > 1
    if chunks is not None:
        chunks.extend(steps[i] for i in ids)
    return [[t for c in steps[i] for t in c] for i in ids], [last[i] for i in ids], ended_in_run


def looping_prompts(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt followed by the first 16 tokens of its greedy output: the output goes on repeating tokens of
    the prompt, so a token can be first emitted inside a run (tokens in a run are copied from the context)."""
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    return [p + o.token_ids for p, o in zip(prompts, outs)]


def stop_inside_runs(chunks: list[list[list[int]]], usable=lambda token: True) -> list[int | None]:
    """Per request, a ``usable`` token first emitted inside a speculative run with more tokens after it (None if
    none): stopping on it must drop the rest of that run."""
    found = []
    for steps in chunks:
        seen: set[int] = set()
        pick = None
        for chunk in steps:
            for j, token in enumerate(chunk):
                if pick is None and j < len(chunk) - 1 and token not in seen and usable(token):
                    pick = token
                seen.add(token)
        found.append(pick)
    return found


def prompts_opening_runs(spec: LLM, prompts: list[list[int]], max_tokens: int, usable=lambda token: True):
    """Prompts whose decoding on ``spec`` (speculating, greedy, ``max_tokens``) starts with an accepted run that
    holds a token new to the output, and the requests' step-by-step tokens on them.

    A run mostly repeats tokens the output already emitted (the loop it follows), so a token first emitted inside
    one is rare on a given prompt. Each prompt is extended with its greedy output up to the token before its first
    run holding a ``usable`` token other than that one: the new prompt's first step emits that token, and its
    second proposes the same drafts from the same context, which the model accepts as before (prompts without such
    a run are kept). The step-by-step tokens come from decoding the new prompts, not from this reasoning."""
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    first: list = []
    drive(spec, prompts, [greedy] * len(prompts), first)
    opened = []
    for prompt, steps in zip(prompts, first):
        out = [t for c in steps for t in c]
        starts = [sum(map(len, steps[:i])) for i in range(len(steps))]  # output index of each step's first token
        cut = next((q for q, c in zip(starts, steps)
                    if q and any(t != out[q - 1] and usable(t) for t in c[:-1])), None)
        opened.append(prompt + out[:cut - 1] if cut else prompt)
    chunks: list = []
    drive(spec, opened, [greedy] * len(opened), chunks)
    return opened, chunks


@pytest.mark.parametrize("mode", ["default", "preemption"])
@pytest.mark.parametrize("device", DEVICES)  # on CUDA the verification runs through the decode graphs
def test_greedy_matches_transformers(reference, mode, device):
    path, prompts, max_tokens, expected = reference
    llm = LLM(model=path, dtype="float32", device=device, **MODES[mode], **SPEC)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    chunks: list = []
    got, outs, ended_in_run = drive(llm, prompts, params, chunks)
    for prompt, tokens, out, ref in zip(prompts, got, outs, expected):
        assert tokens == ref, f"seed={SEED} prompt_len={len(prompt)}"
        assert out.finish_reason == "length" and out.num_output_tokens == len(ref), f"seed={SEED}"
    # Again with max_tokens cut after the second token of each request's first run of 3 or more tokens, so the
    # limit falls inside an accepted run wherever the random limits above missed every run.
    cuts = [next((sum(map(len, steps[:i])) + 2 for i, c in enumerate(steps) if len(c) >= 3), len(ref))
            for steps, ref in zip(chunks, expected)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in cuts]
    got, outs, ended_again = drive(llm, prompts, params)
    for prompt, tokens, out, ref, m in zip(prompts, got, outs, expected, cuts):
        assert tokens == ref[:m], f"seed={SEED} prompt_len={len(prompt)}"
        assert out.finish_reason == "length" and out.num_output_tokens == m, f"seed={SEED}"
    ended_in_run += ended_again
    scheduler = llm.engine.scheduler
    stats = llm.engine.stats()
    assert stats.spec_accepted_tokens > 0 and stats.spec_steps > 0, f"seed={SEED}: nothing was accepted"
    assert ended_in_run > 0, f"seed={SEED}: no max_tokens fell inside an accepted run"
    if mode == "preemption":
        assert scheduler.num_preemptions > 0, f"seed={SEED}: the small KV pool should have forced preemption"
    scheduler.kv.pool.check_all_free()


def test_stop_token_ids_and_seeded_sampling_match_plain_decoding(reference):
    path, prompts, max_tokens, expected = reference
    plain = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=64)
    spec = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=64, **SPEC)
    # A stop token first emitted inside an accepted run, where the run must be cut (prompts opened so each starts
    # with such a run wherever its first pass had one).
    more = looping_prompts(plain, make_prompts(random.Random(SEED + 1), 8))
    prompts, chunks = prompts_opening_runs(spec, prompts + more, 60)
    picks = stop_inside_runs(chunks)
    assert any(t is not None for t in picks), f"seed={SEED}: no run to cut"
    stops = [SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True,
                            stop_token_ids=[t] if t is not None else None) for t in picks]  # token 0 too
    # Seeded sampling draws by (seed, position): the same tokens with or without speculation.
    seeded = [SamplingParams(temperature=0.3, seed=SEED + i, max_tokens=40, ignore_eos=True) for i in range(len(prompts))]
    for params in (stops, seeded):
        want, want_outs, _ = drive(plain, prompts, params)
        got, got_outs, _ = drive(spec, prompts, params)
        assert got == want, f"seed={SEED}"
        assert [(o.finish_reason, o.stop_reason, o.num_output_tokens) for o in got_outs] == \
            [(o.finish_reason, o.stop_reason, o.num_output_tokens) for o in want_outs], f"seed={SEED}"
    assert [o.finish_reason == "stop" for o in drive(plain, prompts, stops)[1]] == [t is not None for t in picks], \
        f"seed={SEED}"
    assert spec.engine.stats().spec_accepted_tokens > 0, f"seed={SEED}"
    spec.engine.scheduler.kv.pool.check_all_free()


def test_aborts_mid_speculation_free_every_block(reference):
    path, prompts, _, _ = reference
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=64, **SPEC)
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)) for p in prompts]
    pool = engine.scheduler.kv.pool
    free_at_start = pool.num_free_blocks
    while engine.scheduler.spec_steps < 3:
        engine.step()
    # Drafts are scheduled for the next step now: abort between schedule and update for half, then the rest.
    plan = engine.scheduler.schedule()
    assert any(s.draft_token_ids for s in plan.scheduled), f"seed={SEED}: no drafts to abort"
    sampled = engine.runner.execute(plan)
    for i in ids[::2]:
        engine.abort(i)
    engine.scheduler.update(plan, sampled.token_ids)
    for i in ids[1::2]:
        engine.abort(i)
    assert not engine.has_unfinished()
    assert pool.num_free_blocks == free_at_start
    pool.check_all_free()


@pytest.fixture(scope="module")
def text_model(tmp_path_factory) -> tuple[str, str]:
    """A random model (it falls into loops: speculation has runs to accept) with the demo checkpoint's tokenizer."""
    from transformers import AutoTokenizer

    demo = str(tmp_path_factory.mktemp("demo") / "model")
    write_demo_model(demo, seed=SEED)
    path = str(tmp_path_factory.mktemp("spec_text"))
    make_hf_model("qwen3_moe", path, seed=SEED, vocab_size=len(AutoTokenizer.from_pretrained(demo)))
    return path, demo


def test_stop_strings_cut_where_plain_decoding_does(text_model):
    path, demo = text_model
    plain = LLM(model=path, tokenizer=demo, dtype="float32", device="cpu", num_kv_blocks=64)
    spec = LLM(model=path, tokenizer=demo, dtype="float32", device="cpu", num_kv_blocks=64, **SPEC)
    vocab = plain.engine.model_config.vocab_size
    rng = random.Random(SEED)
    # The stop is a token's text, so it must be text the output shows: whole characters, not a special token.
    text = lambda token: plain.tokenizer.decode([token], skip_special_tokens=True)  # noqa: E731
    usable = lambda token: bool(text(token)) and "\ufffd" not in text(token)  # noqa: E731
    prompts, chunks = prompts_opening_runs(
        spec, looping_prompts(plain, [[t % vocab for t in p] for p in make_prompts(rng, 12)]), 40, usable)
    # The text of a token first emitted inside a run (plain decoding may find the string earlier: then both stop there).
    stops = [text(t) if t is not None else None for t in stop_inside_runs(chunks, usable)]
    assert any(stops), f"seed={SEED}: no run to cut"
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=stop) for stop in stops]
    want, want_outs, _ = drive(plain, prompts, params)
    got, got_outs, _ = drive(spec, prompts, params)
    for w, g, wt, gt in zip(want_outs, got_outs, want, got):
        assert (gt, g.finish_reason, g.stop_reason, g.num_output_tokens) == \
            (wt, w.finish_reason, w.stop_reason, w.num_output_tokens), f"seed={SEED}"
    # Every stop string is printed within max_tokens (its token is), so every request given one stops.
    assert [o.finish_reason == "stop" for o in got_outs] == [s is not None for s in stops], f"seed={SEED}"
    assert spec.engine.stats().spec_accepted_tokens > 0, f"seed={SEED}"
    spec.engine.scheduler.kv.pool.check_all_free()


@pytest.mark.parametrize("bad", [dict(speculative="medusa"), dict(speculative="ngram", num_speculative_tokens=0),
                                 dict(speculative="ngram", speculative_max_batch=0),
                                 dict(speculative="ngram", speculative_min_acceptance=1.5),
                                 dict(speculative="ngram", overlap_scheduling=True)])
def test_bad_speculative_settings_are_refused(bad):
    from engine.core.config import EngineConfig

    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(model="m", **bad)


def test_parallel_sampling_copies_speculate_each_on_its_own(reference):
    path, prompts, _, _ = reference
    params = SamplingParams(n=3, temperature=0.1, seed=SEED, max_tokens=30, ignore_eos=True)
    plain = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=64)
    spec = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=64, **SPEC)
    want = [(o.index, o.token_ids) for o in plain.generate(prompts[:3], params)]
    got = [(o.index, o.token_ids) for o in spec.generate(prompts[:3], params)]
    assert got == want and len(got) == 9, f"seed={SEED}"
    stats = spec.engine.stats()
    assert stats.spec_accepted_tokens > 0, (SEED, stats.spec_draft_tokens, stats.spec_steps)
    spec.engine.scheduler.kv.pool.check_all_free()
