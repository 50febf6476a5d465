"""What an image model keeps per request and across requests (``engine.models.image_features``, shared by
the image models): an image is encoded once per request, not at all while the encoder cache holds it for
the request's salt, and its cache entry is the request's tenant's, held to that tenant's share (its quota's, else
the cache's). A tower double counts its calls; the reference is a plain dict of what was encoded for whom."""

import random
from types import SimpleNamespace

import torch
from torch import nn

from engine.core.prompt_images import PromptImage
from engine.core.request_policy import RequestPolicy
from engine.models.image_features import ImageFeatures
from engine.vision.encoder_cache import EncoderCache
from engine.vision.qwen3_vl_tower import VisionFeatures
from engine.vision.qwen_image_processing import ProcessedImage

TOKENS, HIDDEN = 4, 8
ENTRY = TOKENS * HIDDEN * 4  # bytes of one image's features (float32 embeds, no deepstack taps)


class CountingTower(ImageFeatures, nn.Module):
    """An image model double: its features are the pixels' first rows; ``encoded`` counts the tower's calls."""

    def __init__(self) -> None:
        super().__init__()
        self.model = SimpleNamespace(embed_tokens=nn.Embedding(2, HIDDEN))
        self.init_image_features()
        self.encoded = 0

    def local_image_step(self, scheduled, ranges, num_rows, device):
        raise AssertionError("these tests read image features, they step nothing")

    # Whole images only here: layer-chunked encoding is never asked of this double.
    encoder_shape = (1, 1)
    tower_block = None
    begin_encoding = encode_passes = finish_encoding = local_image_step

    def encode(self, pixels: ProcessedImage) -> VisionFeatures:
        self.encoded += 1
        embeds = pixels.pixel_values[:TOKENS, :HIDDEN].clone()
        return VisionFeatures(embeds, embeds.new_zeros(0, *embeds.shape))


def _request(rid: str, pictures: list[bytes], tenant: str, share: float | None = None):
    images = tuple(PromptImage(4 * i, 2, 2, digest, ProcessedImage(torch.full((TOKENS, HIDDEN), float(digest[0])),
                                                                   (1, 4, 4)))
                   for i, digest in enumerate(pictures))
    return SimpleNamespace(request_id=rid, images=images,
                           policy=RequestPolicy(tenant=tenant, cache_salt=f"salt-{tenant}", cache_share=share))


def test_encoded_once_per_request_and_per_tenant_while_cached():
    rng = random.Random()
    model = CountingTower()
    model.encoder_cache = EncoderCache(64 * ENTRY)
    want = 0
    seen: set[tuple[bytes, str]] = set()
    for n in range(20):
        tenant = rng.choice("ab")
        pictures = [bytes([rng.randrange(5)]) for _ in range(rng.randint(1, 3))]
        request = _request(f"r{n}", pictures, tenant)
        for _ in range(2):  # a later chunk of the same request reads the same features
            for i, picture in enumerate(pictures):
                got = model.image_features(request, i)
                assert torch.equal(got.embeds, torch.full((TOKENS, HIDDEN), float(picture[0])))
                if (picture, tenant) not in seen:
                    seen.add((picture, tenant))
                    want += 1
                assert model.encoded == want, (n, tenant, pictures)
                assert model.image_cached(picture, f"salt-{tenant}")
        model.forget_images([request.request_id])
    assert model._features == {}


def test_entries_are_the_tenants_and_held_to_its_share():
    model = CountingTower()
    model.encoder_cache = EncoderCache(4 * ENTRY)
    for i in range(2):
        model.image_features(_request(f"b{i}", [bytes([100 + i])], "b"), 0)
    for i in range(3):  # tenant a's quota share: half the cache, so its third image evicts its own first
        model.image_features(_request(f"a{i}", [bytes([i])], "a", share=0.5), 0)
    assert model.encoder_cache.bytes_by_tenant == {"a": 2 * ENTRY, "b": 2 * ENTRY}
    assert not model.image_cached(bytes([0]), "salt-a") and model.image_cached(bytes([2]), "salt-a")
    assert all(model.image_cached(bytes([100 + i]), "salt-b") for i in range(2))
