"""Prefix-cache keys of blocks holding image tokens: each block names exactly the images with placeholders in it,
and the digests are a typed part of the key (never equal to a salt's or an adapter's bytes)."""

import random

from engine.core.block_pool import hash_block_tokens
from engine.core.prompt_images import PromptImage, image_key


def test_a_block_names_the_images_it_holds():
    rng = random.Random()
    a = PromptImage(offset=rng.randint(1, 5), rows=2, cols=3, digest=rng.randbytes(16), pixels=None)  # 6 tokens
    b = PromptImage(offset=a.end + rng.randint(0, 3), rows=1, cols=2, digest=rng.randbytes(16), pixels=None)
    images = (a, b)
    for start in range(0, b.end + 4):
        for end in range(start + 1, b.end + 6):
            # independent reference: token by token, which image (if any) each index belongs to
            held = [im for im in images if any(im.offset <= t < im.end for t in range(start, end))]
            want = b"".join(im.digest for im in held) or None
            assert image_key(images, start, end) == want, (start, end)


def test_image_digests_are_a_typed_part_of_the_key():
    tokens = [random.randrange(1000) for _ in range(4)]
    digest = b"x" * 16
    keys = {hash_block_tokens(None, tokens, None), hash_block_tokens(None, tokens, None, None, digest),
            hash_block_tokens(None, tokens, digest.decode()), hash_block_tokens(None, tokens, None, digest.decode()),
            hash_block_tokens(None, tokens, None, None, b"y" * 16)}
    assert len(keys) == 5
