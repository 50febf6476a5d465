"""Layer-chunked encoding of one picture that several requests hold (``EncoderSteps``'s owners), by simulation (no
model): one request encodes a (digest, cache salt) at a time and the others wait for the encoder cache, but no
request waits for an encoder that is not advancing, so every request finishes whatever holds the slots."""

import random

from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.prompt_images import PromptImage
from engine.core.request import Request, RequestStatus
from engine.core.request_policy import RequestPolicy
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from tests.engine.helpers import run_to_completion


def _request(rid: str, rng: random.Random, layout: list, salt: str | None = None, **policy) -> Request:
    """A prompt of text runs (an int: that many tokens) and images ((rows, cols, digest)): one placeholder each."""
    prompt, images = [], []
    for part in layout:
        if isinstance(part, int):
            prompt += [rng.randrange(1, 50) for _ in range(part)]
        else:
            rows, cols, digest = part
            images.append(PromptImage(len(prompt), rows, cols, digest, None))
            prompt += [99] * (rows * cols)
    return Request(rid, prompt, SamplingParams(ignore_eos=True), max_tokens=rng.randint(1, 6),
                   policy=RequestPolicy(cache_salt=salt, **policy), images=tuple(images))


class _Cache:
    """The encoder cache as the scheduler sees it: an image is held from the plan after its last pass ran (the
    runner puts it after the plan that scheduled the pass), if ``keeps``."""

    def __init__(self, keeps: bool) -> None:
        self.keeps, self.held, self._pending = keeps, set(), set()

    def __call__(self, digest: bytes, salt: str | None) -> bool:
        return (digest, salt) in self.held

    def ran(self, out) -> None:
        self.held |= self._pending
        self._pending = {(p.request.images[p.image].digest, p.request.policy.cache_salt)
                         for p in out.encoder_pieces if p.end == p.total and self.keeps}


def _scheduler(max_seqs: int, budget: int, tokens: int, blocks: int, cache: _Cache, cache_keeps=True) -> Scheduler:
    config = SchedulerConfig(max_seqs, tokens, 512, max_num_encoder_tokens=tokens, max_num_encoder_token_blocks=budget,
                             encoder_stages=2, encoder_patches_per_token=1, encoder_cache_keeps=cache_keeps)
    return Scheduler(config, CacheConfig(4, blocks, True), image_cached=cache)


def test_a_running_request_does_not_wait_for_a_waiting_one_that_cannot_be_admitted():
    """One slot (max_num_seqs 1). ``first``'s picture begins its prompt, so it encodes while still waiting; ``second``
    (the same picture after some text) is then admitted into the only slot for its text and stops before the
    picture. ``first`` cannot be admitted while ``second`` holds the slot; ``second`` must not wait for it."""
    rng = random.Random(0)
    cache = _Cache(keeps=True)
    sched = _scheduler(max_seqs=1, budget=2, tokens=16, blocks=40, cache=cache)
    first = _request("first", rng, [(2, 2, b"pic"), 3])
    second = _request("second", rng, [3, (2, 2, b"pic"), 2])
    sched.add_request(first)
    sched.add_request(second)
    run_to_completion(sched, rng, max_steps=200, on_step=cache.ran)
    assert first.status == second.status == RequestStatus.FINISHED_LENGTH


def test_random_workloads_sharing_pictures_finish_and_encode_each_at_most_once_a_step():
    """Random requests drawing their pictures from three, under two salts and two priority classes, some of them
    background, in one to three slots, with budgets below and above an image's tower, an encoder cache that keeps
    them or not (its share too small, or ``encoder_cache_gb`` 0) and KV blocks few enough to preempt: every
    request finishes, and where the cache keeps anything no step advances one (picture, salt) for two requests."""
    for _ in range(60):
        seed = random.randrange(2**31)
        rng = random.Random(seed)
        cache = _Cache(keeps=rng.random() < 0.7)
        pics = [rng.randbytes(8) for _ in range(3)]
        reqs = []
        for i in range(rng.randint(2, 7)):
            layout = [rng.choice([0, 3, 4, 5])]
            for _ in range(rng.randint(1, 3)):
                side = rng.randint(1, 3)
                layout += [(side, side, rng.choice(pics)), rng.randint(0, 4)]
            background = rng.random() < 0.3  # the Batch API's lines: their own, least urgent class
            reqs.append(_request(f"r{i}", rng, layout, salt=rng.choice(["a", "b"]),
                                 priority=2 if background else rng.choice([0, 1]), background=background))
        share = cache.keeps or rng.random() < 0.5  # a cache that keeps something, not these pictures (its share)
        sched = _scheduler(rng.randint(1, 3), rng.randint(1, 20), rng.randint(8, 32), rng.randint(20, 50), cache,
                           cache_keeps=share)
        for r in reqs:
            sched.add_request(r)

        def check(out):
            cache.ran(out)
            owners = {}
            for p in out.encoder_pieces:
                key = (p.request.images[p.image].digest, p.request.policy.cache_salt)
                assert not share or owners.setdefault(key, p.request.request_id) == p.request.request_id, seed

        run_to_completion(sched, rng, max_steps=2000, on_step=check)
        assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs), seed


def test_with_an_encoder_cache_that_keeps_nothing_no_request_waits_for_another():
    """``encoder_cache_gb`` 0: waiting for another request's encoding would gain nothing (there is no cache to
    read it from) and would serialize the requests' towers. Three requests with the same picture after some text,
    a budget of more than three images' towers a step: each one's picture runs in the first step."""
    rng = random.Random(1)
    cache = _Cache(keeps=False)
    sched = _scheduler(max_seqs=3, budget=40, tokens=48, blocks=40, cache=cache, cache_keeps=False)
    reqs = [_request(f"r{i}", rng, [rng.randint(1, 5), (2, 2, b"pic"), 3]) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert sorted(p.request.request_id for p in out.encoder_pieces if p.end == p.total) == ["r0", "r1", "r2"]
    sched.update(out, [rng.randrange(50) if s.sample else None for s in out.scheduled])
    run_to_completion(sched, rng, max_steps=200, on_step=cache.ran)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
