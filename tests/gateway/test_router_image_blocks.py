"""The replica router keys a prompt's blocks that hold image placeholder tokens by the image, as the engine keys its
prefix cache: the same text with another picture is no prefix hit past the blocks before the image (so it goes where
a new prompt goes), and the same picture again goes to the replica that was sent it.

A real ``ReplicaRouter`` over two ``EngineClient`` doubles (each answers one token at once) serving a tiny
Qwen3-VL-MoE's config. The reference is what the engine's own keys would share, worked out token by token: the
leading blocks whose tokens and images (by the engine's digests of their pixels, ``attach_images``) agree."""

import asyncio
import io
import json
import random

import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.outputs import RequestOutput
from engine.core.request_policy import RequestPolicy
from engine.core.sampling_params import SamplingParams
from engine.serving.protocol import Ready
from engine.vision.prompt_images import attach_images
from engine.vision.qwen_image_processing import process_image
from gateway.replica_router import ReplicaRouter
from tests.engine.vision.qwen3_vl_checkpoint import (IMAGE_CONFIG, IMAGE_TOKEN, VISION_END, VISION_START, VOCAB,
                                                     random_image, text_ids, write_preprocessor_config)

pytestmark = pytest.mark.timeout(60)
BS = 4  # tokens per block
POLICY = RequestPolicy(cache_salt="tenant-a")


class AnswerAtOnce:
    """An ``EngineClient`` double serving the image model: each request gets one token at once; ``sent`` records
    the images of every request sent here."""

    def __init__(self, model_dir: str) -> None:
        self.config = EngineConfig(model=model_dir, block_size=BS, max_num_seqs=4)
        self.info = Ready("demo", "Qwen3VLMoeForConditionalGeneration", 4096, VOCAB, has_tokenizer=False,
                          block_size=BS)
        self.dead = None
        self.stats = None
        self.sent: list[tuple[bytes, ...]] = []

    def silent_s(self) -> float:
        return 0.0

    async def generate(self, prompt, sampling_params, request_id=None, policy=None, stream=True, images=()):
        self.sent.append(tuple(images))
        yield RequestOutput(request_id, [1], "x", True, "length", len(prompt), 0, 1)


def _model_dir(tmp_path) -> str:
    """The checkpoint files the gateway reads of an image model: its config (placeholder id, vision settings)
    and its preprocessor's."""
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"architectures": ["Qwen3VLMoeForConditionalGeneration"], "image_token_id": IMAGE_TOKEN,
                   "vision_config": {"patch_size": IMAGE_CONFIG.patch_size,
                                     "temporal_patch_size": IMAGE_CONFIG.temporal_patch_size,
                                     "spatial_merge_size": IMAGE_CONFIG.merge_size}}, f)
    write_preprocessor_config(str(tmp_path))
    return str(tmp_path)


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _prompt(rng: random.Random, lead: int, num_tokens: list[int]) -> list[int]:
    """``lead`` text tokens, then per image <vision_start>, its placeholders, <vision_end> and text."""
    ids = text_ids(rng, lead)
    for n in num_tokens:
        ids += [VISION_START] + [IMAGE_TOKEN] * n + [VISION_END] + text_ids(rng, rng.randint(1, 6))
    return ids


def _engine_shared_blocks(prompt: list[int], a: list[bytes], b: list[bytes]) -> int:
    """How many leading full blocks of ``prompt`` the engine keys alike with images ``a`` and with ``b``: token
    by token, the blocks before the first one that holds a placeholder of an image whose pixels differ."""
    ia = attach_images(prompt, a, IMAGE_TOKEN, IMAGE_CONFIG)
    ib = attach_images(prompt, b, IMAGE_TOKEN, IMAGE_CONFIG)
    for block in range(len(prompt) // BS):
        for t in range(block * BS, (block + 1) * BS):
            held = [(x.digest, y.digest) for x, y in zip(ia, ib) if x.offset <= t < x.end]
            if any(dx != dy for dx, dy in held):
                return block
    return len(prompt) // BS


def _draw_pair(gen: torch.Generator, rng: random.Random):
    """Two different pictures of one size (so the same prompt text fits either) and their token count."""
    w, h = rng.randint(8, 30), rng.randint(8, 30)
    first, second = random_image(gen, w, h), random_image(gen, w, h)
    return _png(first), _png(second), process_image(first, IMAGE_CONFIG).num_tokens(IMAGE_CONFIG.merge_size)


async def _send(router: ReplicaRouter, prompt: list[int], images: list[bytes]) -> int:
    """Send one request; the index of the replica that ran it."""
    before = [len(r.sent) for r in router.replicas]
    async for _ in router.generate(prompt, SamplingParams(max_tokens=1), policy=POLICY, images=images):
        pass
    (where,) = [i for i, r in enumerate(router.replicas) if len(r.sent) > before[i]]
    assert router.replicas[where].sent[-1] == tuple(images)
    return where


def test_the_same_text_with_another_image_is_no_prefix_hit(tmp_path):
    seed = random.randrange(2**31)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    model_dir = _model_dir(tmp_path)

    async def scenario():
        router = ReplicaRouter([AnswerAtOnce(model_dir), AnswerAtOnce(model_dir)], ["r0", "r1"])
        x, y, n = _draw_pair(gen, rng)
        prompt = _prompt(rng, rng.randint(0, 2), [n])  # the image's first token in the first block
        full = len(prompt) // BS
        assert _engine_shared_blocks(prompt, [x], [y]) == 0, f"seed={seed}"  # the engine shares no block
        held = await _send(router, prompt, [x])
        other = 1 - held
        # another picture: placed as a new prompt (on the replica without one), not after the first
        assert await _send(router, prompt, [y]) == other, f"seed={seed}"
        # each picture again: the replica that was sent it
        assert await _send(router, prompt, [x]) == held, f"seed={seed}"
        assert await _send(router, prompt, [y]) == other, f"seed={seed}"
        for picture, there in ((x, held), (y, other)):
            want = [full if i == there else 0 for i in range(2)]
            assert router.matched_blocks(prompt, POLICY.cache_salt, [picture]) == want, f"seed={seed}"

    asyncio.run(scenario())


def test_matched_blocks_follow_the_engines_image_keys(tmp_path):
    """Prompts with text before the images (its blocks shared whatever the pictures) and one or two images, the
    second request changing one of them: the router's match is exactly the blocks the engine would share."""
    seed = random.randrange(2**31)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    model_dir = _model_dir(tmp_path)

    async def scenario():
        router = ReplicaRouter([AnswerAtOnce(model_dir)], ["r0"])
        for case in range(6):
            pairs = [_draw_pair(gen, rng) for _ in range(rng.randint(1, 2))]
            prompt = _prompt(rng, rng.randint(0, 14), [n for _, _, n in pairs])
            first = [x for x, _, _ in pairs]
            changed = rng.randrange(len(pairs))
            second = [y if i == changed else x for i, (x, y, _) in enumerate(pairs)]
            await _send(router, prompt, first)
            want = _engine_shared_blocks(prompt, first, second)
            where = f"seed={seed} case {case}"
            assert router.matched_blocks(prompt, POLICY.cache_salt, second) == [want], where
            assert router.matched_blocks(prompt, POLICY.cache_salt, first) == [len(prompt) // BS], where
            assert router.matched_blocks(prompt, "tenant-b", first) == [0], where

    asyncio.run(scenario())
