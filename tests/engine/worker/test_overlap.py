"""Overlapped scheduling against the synchronous loop on the same engine settings (the reference).

The overlapped loop launches step N+1 before it reads step N's tokens; these tests check that it
produces the synchronous loop's greedy tokens, finish reasons and usage counts, never computes a token
past a request's stop or ``max_tokens``, and frees every block after aborts and preemptions.
"""

import json
import random

import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.scheduler import PLACEHOLDER
from engine.core.structured_output_spec import StructuredOutput
from tests import greedy_ties
from tests.hf_models import make_hf_model

VOCAB = 211
# On a GPU the same comparisons run on CUDA: pinned copies behind an event instead of a worker thread.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    seed = random.randrange(2**31)
    path = str(tmp_path_factory.mktemp(f"overlap-model-seed{seed}-"))  # the seed in failures that name the path
    make_hf_model("qwen3_moe", path, seed=seed, vocab_size=VOCAB)
    return path


@pytest.fixture(scope="module")
def demo_path(tmp_path_factory):
    """The demo checkpoint (random weights with a real tokenizer): stop strings and grammars need text."""
    from engine.loading.demo_model import write_demo_model

    path = str(tmp_path_factory.mktemp("overlap-demo"))
    write_demo_model(path, seed=random.randrange(2**31))
    return path


def assert_greedy_equal_up_to_a_near_tie(path: str, prompt: list[int], got: list[int], want: list[int], where: str):
    """``tests.greedy_ties``' check against transformers' model at ``path`` (loaded only where they differ)."""
    def last_logits(ids: list[int]) -> torch.Tensor:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return hf(torch.tensor([ids])).logits[0, -1]  # [V]

    greedy_ties.assert_greedy_equal_up_to_a_near_tie(last_logits, prompt, got, want, where)


def engine(path: str, overlap: bool, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 96)  # room for every request at once, without the default pool's allocation
    return LLM(model=path, dtype="float32", device=DEVICE, overlap_scheduling=overlap, block_size=16, **kw)


def workload(rng: random.Random, n: int = 12) -> list[tuple[list[int], SamplingParams]]:
    """Prompts sharing prefixes (prefix-cache hits), long ones (chunked prefill), short and long outputs."""
    shared = [rng.randrange(1, VOCAB) for _ in range(40)]
    reqs = []
    for i in range(n):
        own = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 90))]
        prompt = shared[:rng.choice([0, 17, 40])] + own
        reqs.append((prompt, SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 30), ignore_eos=True)))
    return reqs


def watch_schedules(llm: LLM) -> list[str]:
    """Record every scheduled part that would compute a token past its request's ``max_tokens``."""
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule
    overruns: list[str] = []

    def checked():
        plan = schedule()
        for s in plan.scheduled:
            r = s.request
            sampled_index = s.start + s.num_new_tokens - r.num_prompt_tokens  # output index of the token sampled
            if s.sample and sampled_index >= r.max_tokens:
                overruns.append(f"{r.request_id}: samples output {sampled_index} of max_tokens {r.max_tokens}")
        return plan

    scheduler.schedule = checked
    return overruns


def run(llm: LLM, reqs) -> list:
    outs = llm.generate([p for p, _ in reqs], [sp for _, sp in reqs])
    scheduler = llm.engine.scheduler
    scheduler.kv.pool.check_all_free()
    assert not scheduler.running and not scheduler.waiting and not llm.engine.has_unfinished()
    return outs


def summary(out) -> tuple:
    return out.token_ids, out.finish_reason, out.stop_reason, out.num_output_tokens, out.num_cached_tokens > 0


@pytest.mark.parametrize("settings", [
    dict(max_num_batched_tokens=32),  # chunked prefill mixed with decodes, prefix hits
    dict(num_kv_blocks=14, max_num_batched_tokens=48),  # preemption (asserted below)
], ids=["chunked", "preemption"])
def test_overlap_equals_synchronous_loop(model_path, settings):
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    reqs = workload(rng)
    if "num_kv_blocks" in settings:
        # Two long requests first, each needing 9 of the 14 blocks at its end: both run at once from the start, so
        # the pool runs out before either can finish, whatever the rest of the workload is.
        reqs = [([rng.randrange(1, VOCAB) for _ in range(110)], SamplingParams(temperature=0.0, max_tokens=30,
                                                                                 ignore_eos=True))
                for _ in range(2)] + reqs
    sync, overlapped = engine(model_path, False, **settings), engine(model_path, True, **settings)
    overruns = watch_schedules(overlapped)
    expected, got = run(sync, reqs), run(overlapped, reqs)
    for (prompt, sp), e, g in zip(reqs, expected, got):
        assert g.token_ids == e.token_ids, f"seed={seed} prompt_len={len(prompt)}"
        assert g.finish_reason == "length" and g.num_output_tokens == sp.max_tokens == len(g.token_ids)
    assert not overruns, overruns
    stats = overlapped.engine.stats()
    assert stats.prefix_hit_tokens > 0, "shared prefixes should hit the prefix cache"
    if "num_kv_blocks" in settings:
        # The two long requests cannot both finish in 14 blocks: both loops must preempt.
        assert sync.engine.scheduler.num_preemptions > 0 and overlapped.engine.scheduler.num_preemptions > 0


def test_stops_are_never_overrun(model_path):
    """Stop token ids and max_tokens end a request at the same token as the synchronous loop, with the same
    usage; the token its next (already launched) step sampled is never emitted."""
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 60))] for _ in range(10)]
    free = engine(model_path, False).generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    params = []
    for i, out in enumerate(free):
        # Stop at a token the free run produced in its middle (so the stop lands mid-generation), or by length.
        # The first request is given room to reach its stop and the second no stop, so both endings happen (random
        # choices alone ended every request by length about 1 run in 150).
        stop = out.token_ids[rng.randint(1, 20)]
        stops = i == 0 or (i > 1 and rng.random() < 0.7)
        params.append(SamplingParams(temperature=0.0, max_tokens=24 if i == 0 else rng.randint(1, 24),
                                     ignore_eos=True, stop_token_ids=[stop] if stops else []))
    reqs = list(zip(prompts, params))
    sync, overlapped = engine(model_path, False), engine(model_path, True)
    overruns = watch_schedules(overlapped)
    expected, got = run(sync, reqs), run(overlapped, reqs)
    assert [summary(g) for g in got] == [summary(e) for e in expected], f"seed={seed}"
    assert any(e.finish_reason == "stop" for e in expected) and any(e.finish_reason == "length" for e in expected)
    assert not overruns, overruns
    for (_, sp), g in zip(reqs, got):
        stops = [i for i, t in enumerate(g.token_ids) if t in sp.stop_token_ids]
        assert stops in ([], [len(g.token_ids) - 1]), "nothing is emitted after a stop token"


def test_aborts_and_preemptions_free_every_block(model_path):
    """Aborts while a step is in flight (the aborted request's token still on the device) and preemptions
    leave the pool as it started; the requests left run to the synchronous loop's tokens."""
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    # Prompts of 28-32 tokens (2 blocks of 16) that need a third block within a few tokens: six are admitted into
    # the 12-block pool and grow together, so it preempts before the aborts thin them out.
    reqs = [([rng.randrange(1, VOCAB) for _ in range(rng.randint(28, 32))],
             SamplingParams(temperature=0.0, max_tokens=rng.randint(20, 30), ignore_eos=True)) for _ in range(8)]
    settings = dict(num_kv_blocks=12, max_num_batched_tokens=48)
    expected = run(engine(model_path, False, **settings), reqs)
    llm = engine(model_path, True, **settings)
    eng = llm.engine
    free_at_start = eng.scheduler.kv.pool.num_free_blocks
    for i, (prompt, sp) in enumerate(reqs):
        eng.add_request(prompt, sp, request_id=str(i))
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(reqs))}
    aborted = set()
    steps = 0
    while eng.has_unfinished():
        for out in eng.step():
            outputs[out.request_id] += out.token_ids
        steps += 1
        in_flight = [r for r in eng.scheduler.running if r.all_token_ids[-1] == PLACEHOLDER]
        if steps % 5 == 0 and in_flight:  # abort a request whose token is still on the device
            victim = rng.choice(in_flight)
            eng.abort(victim.request_id)
            aborted.add(victim.request_id)
            assert PLACEHOLDER not in victim.all_token_ids and victim.num_output_tokens == len(outputs[victim.request_id])
    assert aborted and eng.scheduler.num_preemptions > 0, f"seed={seed}: the workload should abort and preempt"
    assert eng.scheduler.kv.pool.num_free_blocks == free_at_start
    eng.scheduler.kv.pool.check_all_free()
    for i, e in enumerate(expected):
        got = outputs[str(i)]
        if str(i) not in aborted:
            assert len(got) == len(e.token_ids), f"seed={seed} request {i}"
        # Preemptions fall on other steps than the synchronous run's, so batches (and float sums) differ.
        assert_greedy_equal_up_to_a_near_tie(model_path, reqs[i][0], got, e.token_ids,
                                              f"seed={seed} request {i} model {model_path}")


def watch_launches(llm: LLM) -> list[tuple[bool, bool]]:
    """Record each launch made while a step was in flight: (whether it first waited for that step to be read,
    whether the plan held a constrained request whose input token was that step's)."""
    eng = llm.engine
    step_overlapped, launch = eng._step_overlapped, eng._overlap.launch
    launches: list[tuple[bool, bool]] = []
    seen = {}

    def stepping(plan):
        seen["in_flight"] = eng._in_flight is not None
        seen["grammar"] = any(s.token_ids[-1] == PLACEHOLDER and s.request.sampling_params.structured_output
                              for s in plan.scheduled)  # read before a wait fills the placeholders
        return step_overlapped(plan)

    def launching(plan, prev):
        if seen["in_flight"]:
            launches.append((prev is None, seen["grammar"]))
        if DEVICE != "cuda":
            return launch(plan, prev)
        torch.cuda.set_sync_debug_mode("error")  # a launch that waited for the device would raise
        try:
            return launch(plan, prev)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    eng._step_overlapped, eng._overlap.launch = stepping, launching
    return launches


def same_logprobs(got, expected) -> bool:
    if (got is None) != (expected is None):
        return False
    return got is None or (got.token_ids == expected.token_ids and got.top_ids == expected.top_ids
                           and got.logprobs == pytest.approx(expected.logprobs, abs=1e-5))


@pytest.mark.parametrize("settings", [
    dict(max_num_batched_tokens=512),  # every prompt in the first step: a copy released early would miss the cache
    dict(num_kv_blocks=14, max_num_batched_tokens=48),  # chunked prompts and preemption (asserted below)
], ids=["whole-prompts", "preemption"])
def test_host_work_overlaps_with_the_synchronous_tokens(model_path, settings):
    """Requests that ask for host work on their tokens (logprobs, prompt logprobs, penalties over a history
    whose last token is still on the device, logit_bias, min_tokens, seeds, n > 1 copies sharing one
    prefill) share overlapped steps with plain ones: every step overlaps (none waits for the step in flight)
    and every request gets the synchronous loop's tokens, logprobs and prompt logprobs."""
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    stop = rng.randrange(VOCAB)
    kinds = [dict(), dict(logprobs=rng.randint(0, 5)), dict(prompt_logprobs=rng.randint(0, 3)),
             dict(frequency_penalty=2.0, presence_penalty=1.0), dict(repetition_penalty=3.0),
             dict(logit_bias={rng.randrange(VOCAB): 5.0, rng.randrange(VOCAB): -100.0}),
             # The biased stop token is every step's pick once allowed: the request ends right after min_tokens.
             dict(min_tokens=6, stop_token_ids=[stop], logit_bias={stop: 100.0}, max_tokens=24),
             dict(temperature=1.0, seed=rng.randrange(2**31), logprobs=2, frequency_penalty=1.0), dict(n=2)]
    # Lengths (prompt and output) from a fixed generator: they alone decide when blocks run out, and with these
    # both loops preempt (4 times each, counted below); the tokens and the kinds' parameters are fresh each run.
    lengths = random.Random(2)
    reqs = []
    for i in range(12):
        kind = kinds[i % len(kinds)]
        # The n=2 prompt fills two blocks, which its second copy finds in the prefix cache.
        num_prompt = lengths.randint(33, 40) if "n" in kind else lengths.randint(3, 40)
        prompt = [rng.randrange(1, VOCAB) for _ in range(num_prompt)]
        extra = dict(temperature=0.0, max_tokens=lengths.randint(8, 24), ignore_eos=True) | kind
        reqs.append((prompt, SamplingParams(**extra)))
    sync, overlapped = engine(model_path, False, **settings), engine(model_path, True, **settings)
    launches = watch_launches(overlapped)
    expected, got = run(sync, reqs), run(overlapped, reqs)
    assert len(got) == len(expected) == len(reqs) + 1  # the n=2 request's two choices
    preempting = "num_kv_blocks" in settings
    for e, g in zip(expected, got):
        # Under preemption the loops' timing differs, and with it which blocks are still cached.
        assert summary(g)[:4] == summary(e)[:4] and (preempting or summary(g) == summary(e)), (
            f"seed={seed} request {g.request_id}")
        assert same_logprobs(g.logprobs, e.logprobs), f"seed={seed} request {g.request_id}"
        assert same_logprobs(g.prompt_logprobs, e.prompt_logprobs), f"seed={seed} request {g.request_id}"
    for (_, sp), e in zip(reqs, expected):
        if sp.min_tokens:
            assert e.token_ids[-1] == stop and len(e.token_ids) == sp.min_tokens + 1, f"seed={seed}"
    if preempting:
        assert sync.engine.scheduler.num_preemptions > 0 and overlapped.engine.scheduler.num_preemptions > 0
    else:
        ids = [e.request_id for e in expected]
        copies = [(e, g) for e, g in zip(expected, got) if ids.count(e.request_id) == 2]  # the n=2 request's
        assert len(copies) == 2 and all(o.num_cached_tokens >= 32 for o in copies[1]), f"seed={seed}: {copies}"
    assert len(launches) >= 5 and not any(waited for waited, _ in launches), f"seed={seed}: {launches}"


def test_stop_strings_one_step_behind(demo_path):
    """With a tokenizer (the demo checkpoint): stop strings, applied one step behind, end requests
    where the synchronous loop ends them, with the same text and usage."""
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    prompts = ["The lighthouse keeper", "Numbers appear everywhere", "Once upon a time", "héllo wörld"]
    settings = dict(max_num_batched_tokens=64)
    free = engine(demo_path, False, **settings).generate(prompts, SamplingParams(temperature=0.0, max_tokens=30))
    params = []
    for out in free:
        text = out.text
        cut = rng.randint(len(text) // 3, max(len(text) // 3, len(text) - 3)) if len(text) > 6 else 0
        stop = [text[cut:cut + 3]] if cut else []  # a stop string the free run prints mid-way
        params.append(SamplingParams(temperature=0.0, max_tokens=30, stop=stop))
    reqs = list(zip(prompts, params))
    sync, overlapped = engine(demo_path, False, **settings), engine(demo_path, True, **settings)
    expected, got = run(sync, reqs), run(overlapped, reqs)
    for e, g in zip(expected, got):
        assert (g.text, *summary(g)) == (e.text, *summary(e)), f"seed={seed}"
    assert any(e.finish_reason == "stop" for e in expected), f"seed={seed}: a stop string should end a request"


def test_constrained_requests_wait_only_for_their_own_tokens(demo_path):
    """Grammar-constrained requests (the mask of a token follows from the one before) share the batch with
    plain ones: a step waits for the step in flight to be read exactly when it holds a constrained request's
    next token, and every output equals the synchronous loop's (text, usage, logprobs); each constrained one
    validates against its schema (the independent ``jsonschema`` package)."""
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "n"], "additionalProperties": False}
    constrained = StructuredOutput(json_schema=json.dumps(schema))
    reqs = []
    for i in range(6):
        prompt = [rng.randrange(10, 1300) for _ in range(rng.randint(3, 40))]
        if i % 2:
            params = SamplingParams(temperature=1.0, seed=rng.randrange(2**31), max_tokens=80, logprobs=i % 3 or None,
                                    structured_output=constrained)
        else:  # long enough to go on after the constrained ones end: steps that overlap again
            params = SamplingParams(temperature=0.0, max_tokens=rng.randint(30, 60), ignore_eos=True)
        reqs.append((prompt, params))
    sync, overlapped = engine(demo_path, False), engine(demo_path, True)
    launches = watch_launches(overlapped)
    expected, got = run(sync, reqs), run(overlapped, reqs)
    for (_, sp), e, g in zip(reqs, expected, got):
        assert (g.text, *summary(g)) == (e.text, *summary(e)), f"seed={seed}"
        assert same_logprobs(g.logprobs, e.logprobs), f"seed={seed}"
        if sp.structured_output is not None:
            assert g.finish_reason == "stop", (seed, g.text)
            jsonschema.validate(json.loads(g.text), schema)
    assert all(waited == grammar for waited, grammar in launches), f"seed={seed}: {launches}"
    assert any(waited for waited, _ in launches) and not all(waited for waited, _ in launches), f"seed={seed}"


def test_seeded_sampling_matches(model_path):
    """Seeded random sampling (each request its own generator) draws the same tokens overlapped: the
    tokens fed on the device are the ones the host later reads."""
    rng = random.Random(random.randrange(2**31))
    reqs = [([rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 50))],
             SamplingParams(temperature=rng.uniform(0.5, 1.5), top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 20]),
                            seed=rng.randrange(2**31), max_tokens=rng.randint(5, 25), ignore_eos=True))
            for _ in range(6)]
    expected, got = run(engine(model_path, False), reqs), run(engine(model_path, True), reqs)
    assert [summary(g) for g in got] == [summary(e) for e in expected]


class _FakeDevice:
    """A deterministic 'model' over a paged KV store, as the runner sees steps: each scheduled chunk writes its
    tokens into its slots (placeholders take the previous step's sample, as the device fills them), and a
    sampling chunk's token is a function of every token its block table holds before it. Independent of how
    steps are batched; wrong if a block is shared or reused while still needed."""

    def __init__(self, vocab: int, block_size: int) -> None:
        self.vocab = vocab
        self.block_size = block_size
        self.slots: dict[int, int] = {}

    def _slot(self, block_ids: list[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def run(self, plan, prev_samples: dict[str, int]) -> tuple[list[int | None], dict[str, int]]:
        tokens, samples = [], {}
        for s in plan.scheduled:
            for i, t in enumerate(s.token_ids):
                token = prev_samples[s.request.request_id] if t == PLACEHOLDER else t
                self.slots[self._slot(s.block_ids, s.start + i)] = token
        for s in plan.scheduled:
            if not s.sample:
                tokens.append(None)
                continue
            end = s.start + s.num_new_tokens
            token = (sum(self.slots[self._slot(s.block_ids, p)] * (p + 7) for p in range(end)) + 3 * end) % self.vocab
            tokens.append(token)
            samples[s.request.request_id] = token
        return tokens, samples


def test_scheduler_overlapped_equals_synchronous_under_preemption_aborts_and_stops():
    """The scheduler alone (no torch), many random workloads: advance/resolve with placeholders produce every
    request's synchronous tokens and finish, through preemption (a tiny pool), prefix hits, stop tokens,
    max_tokens, the model length, and aborts of requests whose token is in flight; every block comes back."""
    from engine.core.request import Request
    from tests.engine.helpers import make_scheduler

    preempting_runs = 0
    for seed in [random.randrange(2**31) for _ in range(30)]:
        rng = random.Random(seed)
        vocab = 40
        shared = [rng.randrange(vocab) for _ in range(12)]
        specs = []
        for i in range(rng.randint(3, 10)):
            prompt = shared[:rng.choice([0, 5, 12])] + [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
            stops = [rng.randrange(vocab)] if rng.random() < 0.5 else []
            specs.append((f"r{i}", prompt, SamplingParams(ignore_eos=True, stop_token_ids=stops), rng.randint(1, 25)))
        aborts = {f"r{i}": rng.randint(1, 30) for i in range(len(specs)) if rng.random() < 0.2}  # id -> step

        def drive(overlap: bool):
            sched = make_scheduler(num_blocks=rng_blocks, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                                   max_model_len=48)
            free_at_start = sched.kv.pool.num_free_blocks
            reqs = {rid: Request(rid, p, sp, max_tokens=min(m, 48 - len(p))) for rid, p, sp, m in specs}
            for r in reqs.values():
                sched.add_request(r)
            device, in_flight, step = _FakeDevice(vocab, 4), None, 0
            while sched.has_unfinished() or in_flight is not None:
                step += 1
                assert step < 2000, f"seed={seed} overlap={overlap}: no progress"
                plan = sched.schedule()
                if not overlap:
                    tokens, _ = device.run(plan, {})
                    sched.update(plan, tokens)
                else:
                    tokens, samples = device.run(plan, in_flight[2] if in_flight else {})
                    if in_flight is not None:
                        sched.resolve(in_flight[0], in_flight[1])
                    sched.advance(plan)
                    in_flight = (plan, tokens, samples) if not plan.is_empty else None
                for rid, at in aborts.items():
                    if at == step:
                        sched.abort(rid)
            sched.kv.pool.check_all_free()
            assert sched.kv.pool.num_free_blocks == free_at_start
            return {rid: (r.output_token_ids, r.status) for rid, r in reqs.items()}, sched.num_preemptions

        rng_blocks = rng.randint(13, 18)  # one request at max_model_len fits (12 blocks); two may not
        (expected, _), (got, preempted) = drive(False), drive(True)
        preempting_runs += preempted > 0
        for rid in expected:
            if rid in aborts:  # aborted at the same step count, which is a different point of the run
                shorter, longer = sorted((got[rid][0], expected[rid][0]), key=len)
                assert longer[:len(shorter)] == shorter, f"seed={seed} {rid}"
                continue
            assert got[rid] == expected[rid], f"seed={seed} {rid}"
    assert preempting_runs >= 5, "the small pools should force preemption in many of the runs"
