"""The scheduler's per-step encoder budget by simulation (no model): a step's chunks first touch images worth at
most ``max_num_encoder_tokens`` image tokens (or a single image, whatever its size), images the encoder cache
holds cost nothing, an image request held back by the budget lets the text-only requests behind it start, and
every request still finishes."""

import random

from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.prompt_images import PromptImage
from engine.core.request import Request, RequestStatus
from engine.core.request_policy import RequestPolicy
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from tests.engine.helpers import run_to_completion


def _request(rid: str, rng: random.Random, layout: list[int | tuple[int, int]], salt: str | None = None) -> Request:
    """A prompt of text runs (an int: that many tokens) and images (rows, cols): one placeholder per image token."""
    prompt, images = [], []
    for part in layout:
        if isinstance(part, int):
            prompt += [rng.randrange(1, 50) for _ in range(part)]
        else:
            rows, cols = part
            images.append(PromptImage(len(prompt), rows, cols, rng.randbytes(16), None))
            prompt += [99] * (rows * cols)
    return Request(rid, prompt, SamplingParams(ignore_eos=True), max_tokens=rng.randint(1, 6),
                   policy=RequestPolicy(cache_salt=salt), images=tuple(images))


def _scheduler(budget: int, tokens: int, blocks: int, cached=frozenset()) -> Scheduler:
    return Scheduler(SchedulerConfig(8, tokens, 512, max_num_encoder_tokens=budget), CacheConfig(4, blocks, True),
                     image_cached=lambda digest, salt: (digest, salt) in cached)


def random_image_requests(rng: random.Random) -> tuple[list[Request], frozenset]:
    """2 to 8 requests of text and 0 to 4 images each (1 to 4 tokens a side), half with salt "a", half "b"; and
    a third of their (digest, salt) pairs, for an encoder cache that holds those."""
    reqs = []
    for i in range(rng.randint(2, 8)):
        layout = [rng.randint(0, 6)]
        for _ in range(rng.choice([0, 0, 1, 2, 4])):
            layout += [(rng.randint(1, 4), rng.randint(1, 4)), rng.randint(0, 5)]
        if sum(p if isinstance(p, int) else p[0] * p[1] for p in layout) == 0:
            layout[0] = 1
        reqs.append(_request(f"r{i}", rng, layout, salt=rng.choice(["a", "b"])))
    images = [(im.digest, r.policy.cache_salt) for r in reqs for im in r.images]
    return reqs, frozenset(rng.sample(images, len(images) // 3))


def seeded_image_workloads(trials: int):
    """Per trial a fresh seed (reported by the assertions), its generator, and random_image_requests' output."""
    for trial in range(trials):
        seed = random.randrange(2**31)
        rng = random.Random(seed)
        reqs, cached = random_image_requests(rng)
        yield trial, seed, rng, reqs, cached


def test_random_image_workloads_keep_each_step_within_the_encoder_budget():
    for _, seed, rng, reqs, cached in seeded_image_workloads(20):
        budget = rng.randint(1, 20)
        sched = _scheduler(budget, rng.randint(8, 64), rng.randint(26, 60), cached)  # some preemption
        for r in reqs:
            sched.add_request(r)
        seen: dict[str, set[int]] = {r.request_id: set() for r in reqs}

        def check(out):
            encoded = []  # image tokens this step encodes, per image first touched
            for part in out.scheduled:
                request, end = part.request, part.start + part.num_new_tokens
                for i, im in enumerate(request.images):
                    if im.offset < end and im.end > part.start and i not in seen[request.request_id]:
                        seen[request.request_id].add(i)
                        if (im.digest, request.policy.cache_salt) not in cached:
                            encoded.append(im.num_tokens)
            assert sum(encoded) <= budget or len(encoded) == 1, (seed, encoded, budget)

        run_to_completion(sched, rng, on_step=check)
        assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs), seed
        sched.kv.pool.check_all_free()


def test_image_request_held_back_lets_text_behind_it_start():
    rng = random.Random()
    first = _request("first", rng, [2, (3, 4), 3])  # its 12-token image takes the whole budget
    second = _request("second", rng, [(2, 3), 4])  # starts with an image: not even its first token fits
    text = _request("text", rng, [rng.randint(3, 9)])
    sched = _scheduler(budget=12, tokens=64, blocks=40)
    for r in (first, second, text):
        sched.add_request(r)
    step = sched.schedule()
    assert [p.request.request_id for p in step.scheduled] == ["first", "text"]
    assert step.scheduled[0].num_new_tokens == first.num_tokens
    sched.update(step, [rng.randrange(50) for _ in step.scheduled])
    step = sched.schedule()
    assert "second" in [p.request.request_id for p in step.scheduled]
