"""Layer-chunked encoding in the scheduler by simulation (no model): a step's tower work (the passes of its encoder
pieces, two per patch and stage: ``engine.core.encoder_pieces``) stays within ``max_num_encoder_token_blocks``
however large one block of one image is, each image's pieces run its passes once each, in order, through
preemption too, before any chunk reads its placeholders; images the encoder cache holds get none; and decoding
text streams get their token in every step while an image is encoded."""

import random

from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.request import RequestStatus
from engine.core.scheduler import Scheduler
from tests.engine.core.test_encoder_budget import _request, seeded_image_workloads
from tests.engine.helpers import run_to_completion


def _scheduler(budget: int, depth: int, merge: int, tokens: int, blocks: int, cached=frozenset(),
               attention: float = 0.0) -> Scheduler:
    config = SchedulerConfig(8, tokens, 512, max_num_encoder_tokens=tokens, max_num_encoder_token_blocks=budget,
                             encoder_stages=depth, encoder_patches_per_token=merge,
                             encoder_attention_per_patch=attention)
    return Scheduler(config, CacheConfig(4, blocks, True), image_cached=lambda digest, salt: (digest, salt) in cached)


def test_random_image_workloads_keep_each_step_within_the_token_block_budget():
    splits = pasts = 0
    for _, seed, rng, reqs, cached in seeded_image_workloads(20):
        depth, merge = rng.randint(1, 5), rng.choice([1, 4])
        # often below one block of an image (split over its rows), at times above a whole image, at times a few
        # token-blocks, below one row's attention over a larger image (a pass past the whole budget)
        budget = rng.choice([rng.randint(1, 16 * merge * depth), rng.randint(1, 3)])
        # a block's attention per patch of the image: none, or up to several times its weights for these images
        attention = rng.choice([0.0, rng.uniform(0, 0.2), rng.uniform(0.2, 0.5)])
        sched = _scheduler(budget, depth, merge, rng.randint(8, 64), rng.randint(26, 60), cached,
                           attention)  # some preemption
        for r in reqs:
            sched.add_request(r)
        done: dict[tuple[str, int], int] = {}  # passes run per image, from the pieces seen
        split = 0  # pieces that end inside a stage (one block of the image is past the budget)

        def check(out):
            nonlocal split, pasts
            work, past = 0.0, []  # past: passes that alone cost more than the whole budget
            for piece in out.encoder_pieces:
                request, i = piece.request, piece.image
                key, total = (request.request_id, i), 2 * request.images[i].num_tokens * merge * depth
                assert (request.images[i].digest, request.policy.cache_salt) not in cached, seed
                assert piece.total == total, seed
                assert piece.first == done.get(key, 0) < piece.end <= total, (seed, piece, done.get(key))
                done[key] = piece.end
                patches = request.images[i].num_tokens * merge
                # each pass: one half token-block; a block's mixing of a row (the second half of its passes) also
                # that row's query against every patch of the image, twice a patch's share as a half token-block
                costs = [1.0 + (2 * attention * patches if n >= 2 * patches and n % (2 * patches) >= patches
                                 else 0.0) for n in range(piece.first, piece.end)]
                if len(costs) == 1 and costs[0] > 2 * budget:
                    past.append(costs[0])
                else:
                    work += sum(costs)
                split += piece.end % (total // depth) != 0
            # two passes a token-block, and at most one pass a step that no budget could hold
            assert work <= 2 * budget + 1e-9 and len(past) <= 1, (seed, work, budget, past)
            pasts += len(past)
            for part in out.scheduled:
                request, end = part.request, part.start + part.num_new_tokens
                for i, im in enumerate(request.images):
                    if im.offset < end and im.end > part.start and (im.digest, request.policy.cache_salt) not in cached:
                        assert done.get((request.request_id, i)) == 2 * im.num_tokens * merge * depth, (seed, i)

        run_to_completion(sched, rng, on_step=check)
        assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs), seed
        expected = {(r.request_id, i) for r in reqs for i, im in enumerate(r.images)
                    if (im.digest, r.policy.cache_salt) not in cached}
        totals = {(r.request_id, i): 2 * im.num_tokens * merge * depth for r in reqs for i, im in enumerate(r.images)}
        assert done == {key: totals[key] for key in expected}, seed  # every other image encoded exactly once
        splits += split
        sched.kv.pool.check_all_free()
    assert splits > 0 and pasts > 0  # some budgets split a stage, some are past by one row's attention


def test_text_streams_decode_in_every_step_while_an_image_is_encoded():
    """Three streams decoding, then a request with two 8x8-token images (256 patches each) in a 4-stage tower under
    a budget of 100 token-blocks, below one block of one image: 200 passes a step of the 2 x 2048 the images take
    (two per patch and stage), so 11 steps of tower work an image (the second begun once the chunk reaches it),
    each of which also decodes every stream; the image request's chunk reaches an image only in or after the step
    of that image's last pass."""
    rng = random.Random(0)
    streams = [_request(f"s{i}", rng, [5]) for i in range(3)]
    for s in streams:
        s.max_tokens = 100
    sched = _scheduler(budget=100, depth=4, merge=4, tokens=64, blocks=200)
    for s in streams:
        sched.add_request(s)
    for _ in range(2):  # the streams' prompts, then their first decode
        out = sched.schedule()
        sched.update(out, [rng.randrange(50) if p.sample else None for p in out.scheduled])
    image = _request("image", rng, [3, (8, 8), 2, (8, 8), 4])
    sched.add_request(image)
    tower_steps, finished_at, done = 0, {}, {0: 0, 1: 0}
    for step in range(40):
        out = sched.schedule()
        decoded = {p.request.request_id for p in out.scheduled if p.num_new_tokens == 1 and p.sample}
        assert decoded >= {s.request_id for s in streams}, step
        assert sum(p.end - p.first for p in out.encoder_pieces) <= 200, step
        tower_steps += bool(out.encoder_pieces)
        for piece in out.encoder_pieces:
            assert piece.first == done[piece.image] and piece.total == 2048
            done[piece.image] = piece.end
            if piece.end == piece.total:
                finished_at[piece.image] = step
        for part in out.scheduled:
            if part.request is image:
                for i, im in enumerate(image.images):
                    if im.offset < part.start + part.num_new_tokens:
                        assert finished_at.get(i, step + 1) <= step, (step, i)
        sched.update(out, [rng.randrange(50) if p.sample else None for p in out.scheduled])
        if image.num_output_tokens:
            break
    assert tower_steps == 22 and done == {0: 2048, 1: 2048} and image.num_output_tokens == 1


def test_a_blocks_passes_cost_their_attention_over_the_image():
    """An 8x8-token image merging 4 patches a token (256 patches) through the patch embedding and one block, whose
    attention a patch costs 1/256 of a token-block per patch of the image: the embedding's 512 passes cost one
    each, the block's 256 projections of a row one each and its 256 mixings of a row three each (1 + 2 x 256/256:
    the row's query against all 256 keys, which runs there). Under 128 token-blocks (256 a step), the embedding
    takes 2 steps of 256 passes, the projections one, the mixings 4 (85 of 3 a step, then the last); without the
    attention counted the block would take 2 steps of 256."""
    for attention, want in [(1 / 256, [256, 256, 256, 85, 85, 85, 1]), (0.0, [256, 256, 256, 256])]:
        rng = random.Random(0)
        sched = _scheduler(budget=128, depth=2, merge=4, tokens=64, blocks=50, attention=attention)
        image = _request("image", rng, [3, (8, 8), 2])
        sched.add_request(image)
        passes = []
        while not image.num_output_tokens:
            out = sched.schedule()
            passes += [p.end - p.first for p in out.encoder_pieces]
            sched.update(out, [rng.randrange(50) if p.sample else None for p in out.scheduled])
        assert passes == want, attention


def test_an_image_whose_one_pass_is_past_the_budget_still_advances():
    """A budget of 1 token-block (2 half-blocks a step) against a block's mixing pass of a row costing
    1 + 2 x 0.5 x 4 = 5: such a pass runs anyway, one a step, and a second image waits for the next step rather
    than overrun it."""
    rng = random.Random(1)
    sched = _scheduler(budget=1, depth=2, merge=4, tokens=64, blocks=50, attention=0.5)
    image = _request("image", rng, [3, (1, 1), 2, (1, 1), 2])  # two images of 4 patches: 16 passes each
    sched.add_request(image)
    per_step = []
    while not image.num_output_tokens:
        out = sched.schedule()
        per_step.append([(p.image, p.end - p.first) for p in out.encoder_pieces])
        sched.update(out, [rng.randrange(50) if p.sample else None for p in out.scheduled])
    # each image: the embedding's 8 passes and its block's 4 projections two a step (cost 1 each), then the
    # block's 4 mixings one a step
    one_image = [(2,)] * 6 + [(1,)] * 4
    assert per_step[:10] == [[(0, n[0])] for n in one_image]
    assert per_step[10:20] == [[(1, n[0])] for n in one_image]


def test_the_passes_fitted_never_cost_past_the_room():
    """``EncoderSteps._fitting`` against an exact count (fractions, pass by pass: one half token-block each, a
    block's mixing pass of a row also ``2 a p``): the passes it fits are what fits in the room (up to rounding), and
    what the scheduler then charges for them (``cost``, in floats) is never past the room, so rounding never lets a
    step's ``used`` pass its budget. Rooms are often exactly what some passes cost, summed in floats as the
    scheduler sums them, where a quotient rounded up would fit one pass too many."""
    from fractions import Fraction
    from types import SimpleNamespace

    from engine.core.encoder_pieces import EncoderSteps

    seed = random.randrange(2**31)
    rng = random.Random(seed)
    for _ in range(3000):
        tokens, merge, depth = rng.randint(1, 6), rng.choice([1, 4]), rng.randint(1, 4)
        a = rng.choice([0.0, rng.uniform(0, 0.5), 1 / rng.randint(1, 64)])
        steps = EncoderSteps(1, depth, merge, attention_per_patch=a)
        request = SimpleNamespace(images=[SimpleNamespace(num_tokens=tokens)])
        p, total = tokens * merge, steps.total(request, 0)

        def exact(first: int, end: int) -> Fraction:
            return sum((1 + (2 * Fraction(a) * p if n >= 2 * p and n % (2 * p) >= p else 0)
                        for n in range(first, end)), Fraction(0))

        done = rng.randrange(total)
        if rng.random() < 0.5:  # exactly some passes' cost, summed piece by piece in floats
            room, u = 0.0, done
            for _ in range(rng.randint(1, 3)):
                v = rng.randint(u, total)
                room += float(exact(u, v))
                u = v
        else:
            room = rng.uniform(0, 3 * total)
        k = steps._fitting(request, 0, done, room)
        assert 0 <= k <= total - done, seed
        assert steps.cost(request, 0, done, done + k) <= room, (seed, done, k, room)
        assert exact(done, done + k) <= Fraction(room) + Fraction(1, 10**9), (seed, done, k, room)
        if done + k < total:
            assert exact(done, done + k + 1) > Fraction(room) - Fraction(1, 10**9), (seed, done, k, room)


def test_an_image_past_the_whole_budget_advances_behind_other_image_work():
    """A background-class request whose image's mixing pass of a row costs more than a whole step's budget (a 4x4-
    token image, 64 patches, attention ``a`` 0.3: 1 + 2 x 0.3 x 64 = 39.4 half token-blocks against 32) behind a
    foreground request arriving every step whose small image (1x1 token, 4 patches: 25.6 half token-blocks) always
    runs first and leaves room for the other's cheaper passes but never the whole budget: the big image's mixing
    passes still advance, one a step, and its request is answered. (Were such a pass to run only as a step's first
    it would wait for a step with no other image work, here never.)"""
    from engine.core.request_policy import RequestPolicy

    seed = random.randrange(2**31)
    rng = random.Random(seed)
    config = SchedulerConfig(64, 64, 512, max_num_encoder_tokens=64, max_num_encoder_token_blocks=16,
                             encoder_stages=2, encoder_patches_per_token=4, encoder_attention_per_patch=0.3)
    sched = Scheduler(config, CacheConfig(4, 400, True), image_cached=lambda digest, salt: False)
    big = _request("big", rng, [3, (4, 4), 2])
    big.policy = RequestPolicy(priority=2)
    big.priority = 2
    sched.add_request(big)
    for step in range(400):
        sched.add_request(_request(f"small{step}", rng, [3, (1, 1), 2]))
        out = sched.schedule()
        work = sum(sched.encoder_steps.cost(p.request, p.image, p.first, p.end) for p in out.encoder_pieces)
        oversized = [p for p in out.encoder_pieces if sched.encoder_steps.cost(p.request, p.image, p.first, p.end) > 32]
        # within the budget but for one pass past the whole of it
        assert work <= 32 + 1e-9 or (len(oversized) == 1 and oversized[0].end - oversized[0].first == 1), seed
        sched.update(out, [rng.randrange(50) if p.sample else None for p in out.scheduled])
        if big.num_output_tokens:
            break
    assert big.num_output_tokens, (seed, big.encoder_blocks)
