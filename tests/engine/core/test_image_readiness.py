"""The scheduler never hands the tower an image whose pixels are not ready (``image_ready``: being preprocessed off
the step loop), by simulation (no model), under the encoder budget and under layer-chunked encoding: a chunk stops
before such an image, which waits for a later step (the step says so: ``images_preparing``), images the encoder
cache holds need no pixels, and every request still finishes with every other image encoded once."""

import random

from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.request import RequestStatus
from engine.core.scheduler import Scheduler
from tests.engine.core.test_encoder_budget import seeded_image_workloads
from tests.engine.helpers import run_to_completion


class _Pixels:
    """Each image's pixels ready after a random number of questions (0: at once), as the image worker would."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.left: dict[bytes, int] = {}
        self.refused: list[bytes] = []  # the images answered "not ready" since the last step's check

    def __call__(self, image) -> bool:
        left = self.left.setdefault(image.digest, self.rng.choice([0, 0, 1, 2, 5]))
        if left:
            self.left[image.digest] = left - 1
            self.refused.append(image.digest)
        return not left

    def ready(self, digest: bytes) -> bool:
        return self.left.get(digest) == 0


def test_images_reach_the_tower_only_once_their_pixels_are_ready():
    for trial, seed, rng, reqs, cached in seeded_image_workloads(40):
        tokens, depth = rng.randint(8, 64), rng.randint(1, 4)
        chunked = trial % 2 == 1
        config = SchedulerConfig(8, tokens, 512, max_num_encoder_tokens=rng.randint(1, 20),
                                 max_num_encoder_token_blocks=rng.randint(1, 64 * depth) if chunked else None,
                                 encoder_stages=depth, encoder_patches_per_token=4)
        pixels = _Pixels(rng)
        sched = Scheduler(config, CacheConfig(4, rng.randint(26, 60), True),
                          image_cached=lambda digest, salt: (digest, salt) in cached, image_ready=pixels)
        for r in reqs:
            sched.add_request(r)
        touched: set[tuple[str, int]] = set()

        def check(out):
            assert sched.images_preparing == bool(pixels.refused), seed
            pixels.refused.clear()
            for piece in out.encoder_pieces:
                assert pixels.ready(piece.request.images[piece.image].digest), (seed, piece)
            for part in out.scheduled:
                request, end = part.request, part.start + part.num_new_tokens
                for i, im in enumerate(request.images):
                    if im.offset < end and im.end > part.start and (request.request_id, i) not in touched:
                        touched.add((request.request_id, i))
                        if (im.digest, request.policy.cache_salt) not in cached:
                            assert pixels.ready(im.digest), (seed, request.request_id, i)

        run_to_completion(sched, rng, on_step=check)
        assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs), seed
        assert touched == {(r.request_id, i) for r in reqs for i in range(len(r.images))}, seed
        sched.kv.pool.check_all_free()
