"""Layer-chunked encoding in the scheduler by simulation (no model): a step's tower work (patches x blocks of its
encoder pieces) stays within ``max_num_encoder_token_blocks`` (or is one block of one image), each image's pieces
run its blocks once each, in order, through preemption too, before any chunk reads its placeholders; images the
encoder cache holds get none; and decoding text streams get their token in every step while an image is encoded."""

import random

from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.request import RequestStatus
from engine.core.scheduler import Scheduler
from tests.engine.core.test_encoder_budget import _request, seeded_image_workloads
from tests.engine.helpers import run_to_completion


def _scheduler(budget: int, depth: int, merge: int, tokens: int, blocks: int, cached=frozenset()) -> Scheduler:
    config = SchedulerConfig(8, tokens, 512, max_num_encoder_tokens=tokens, max_num_encoder_token_blocks=budget,
                             encoder_stages=depth, encoder_patches_per_token=merge)
    return Scheduler(config, CacheConfig(4, blocks, True), image_cached=lambda digest, salt: (digest, salt) in cached)


def test_random_image_workloads_keep_each_step_within_the_token_block_budget():
    for _, seed, rng, reqs, cached in seeded_image_workloads(20):
        depth, merge = rng.randint(1, 5), rng.choice([1, 4])
        budget = rng.randint(1, 16 * merge * depth)
        sched = _scheduler(budget, depth, merge, rng.randint(8, 64), rng.randint(26, 60), cached)  # some preemption
        for r in reqs:
            sched.add_request(r)
        done: dict[tuple[str, int], int] = {}  # blocks run per image, from the pieces seen

        def check(out):
            work = []
            for piece in out.encoder_pieces:
                request, i = piece.request, piece.image
                key = (request.request_id, i)
                assert (request.images[i].digest, request.policy.cache_salt) not in cached, seed
                assert piece.first == done.get(key, 0) < piece.end <= depth, (seed, piece, done.get(key))
                done[key] = piece.end
                work.append(request.images[i].num_tokens * merge * (piece.end - piece.first))
            one_block = len(out.encoder_pieces) == 1 and out.encoder_pieces[0].end - out.encoder_pieces[0].first == 1
            assert sum(work) <= budget or one_block, (seed, work, budget)
            for part in out.scheduled:
                request, end = part.request, part.start + part.num_new_tokens
                for i, im in enumerate(request.images):
                    if im.offset < end and im.end > part.start and (im.digest, request.policy.cache_salt) not in cached:
                        assert done.get((request.request_id, i)) == depth, (seed, request.request_id, i)

        run_to_completion(sched, rng, on_step=check)
        assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs), seed
        expected = {(r.request_id, i) for r in reqs for i, im in enumerate(r.images)
                    if (im.digest, r.policy.cache_salt) not in cached}
        assert done == {key: depth for key in expected}, seed  # every other image encoded exactly once
        sched.kv.pool.check_all_free()


def test_text_streams_decode_in_every_step_while_an_image_is_encoded():
    """Three streams decoding, then a request with two 8x8-token images (256 patches each) in a 4-stage tower under
    a budget of 300 token-blocks: one stage a step, so eight steps of tower work, each of which also decodes every
    stream; the image request's chunk reaches an image only in or after the step of that image's last block."""
    rng = random.Random(0)
    streams = [_request(f"s{i}", rng, [5]) for i in range(3)]
    for s in streams:
        s.max_tokens = 100
    sched = _scheduler(budget=300, depth=4, merge=4, tokens=64, blocks=200)
    for s in streams:
        sched.add_request(s)
    for _ in range(2):  # the streams' prompts, then their first decode
        out = sched.schedule()
        sched.update(out, [rng.randrange(50) if p.sample else None for p in out.scheduled])
    image = _request("image", rng, [3, (8, 8), 2, (8, 8), 4])
    sched.add_request(image)
    pieces, finished_at = [], {}
    for step in range(20):
        out = sched.schedule()
        decoded = {p.request.request_id for p in out.scheduled if p.num_new_tokens == 1 and p.sample}
        assert decoded >= {s.request_id for s in streams}, step
        for piece in out.encoder_pieces:
            assert piece.end - piece.first == 1
            pieces.append(piece)
            if piece.end == 4:
                finished_at[piece.image] = step
        for part in out.scheduled:
            if part.request is image:
                for i, im in enumerate(image.images):
                    if im.offset < part.start + part.num_new_tokens:
                        assert finished_at.get(i, step + 1) <= step, (step, i)
        sched.update(out, [rng.randrange(50) if p.sample else None for p in out.scheduled])
        if image.num_output_tokens:
            break
    assert len(pieces) == 8 and image.num_output_tokens == 1
