"""What every model that reads images does with them per request (Qwen3-VL-MoE, Qwen3.5-MoE, Kimi-K2.5): each
image is encoded once per request, the first time a step's chunk holds one of its placeholder tokens, and its
features kept until the request finishes (``forget_images``); an image the encoder cache holds for the request's
tenant is not encoded again (``engine.vision.encoder_cache``)."""

import abc
from collections.abc import Iterator

import torch

from engine.core.request import Request
from engine.core.scheduler import ScheduledRequest
from engine.vision.encoder_cache import EncoderCache
from engine.vision.prompt_images import pixels_of
from engine.vision.qwen_image_processing import ProcessedImage
from engine.vision.qwen3_vl_tower import VisionFeatures


class ImageFeatures(abc.ABC):
    """Mixed into a model class; its ``__init__`` calls ``init_image_features`` and it says how an image is
    encoded (``encode``)."""

    def check_one_rank(self, architecture: str, tp, stage) -> None:
        """ValueError unless the model is served whole on one rank (call before building it): the vision tower
        and the image rows are not split across ranks or stages yet."""
        if tp.size > 1 or stage.pipelined:
            raise ValueError(f"{architecture} with images is served on one rank for now: tensor, expert and "
                             "pipeline parallelism are not supported with it")

    def init_image_features(self) -> None:
        self._features: dict[str, list[VisionFeatures | None]] = {}
        # Encoded images across requests; the engine sizes it (EngineConfig.encoder_cache_gb), 0 keeps nothing.
        self.encoder_cache = EncoderCache(0)

    @abc.abstractmethod
    def encode(self, pixels: ProcessedImage) -> VisionFeatures:
        """One image's features, one row per placeholder token."""

    def image_features(self, request: Request, i: int) -> VisionFeatures:
        """Image ``i`` of ``request``: kept for the request, else from the encoder cache, else encoded now."""
        feats = self._features.setdefault(request.request_id, [None] * len(request.images))
        if feats[i] is None:
            image, policy = request.images[i], request.policy
            device = self.model.embed_tokens.weight.device
            feats[i] = self.encoder_cache.get(image.digest, policy.cache_salt, device)
            if feats[i] is None:
                feats[i] = self.encode(pixels_of(image.pixels))  # preprocessed now if its bytes were seen before
                # held to the tenant's share of the cache (its quota's cache share, else the engine's flag)
                self.encoder_cache.put(image.digest, policy.cache_salt, feats[i], policy.tenant, policy.cache_share)
        return feats[i]

    def image_rows(self, part: ScheduledRequest, a: int,
                   b: int) -> Iterator[tuple[torch.Tensor, VisionFeatures, slice]]:
        """For each image with placeholder tokens in the part (its flat rows ``a:b``): (those rows [n] int64, the
        image's features, the slice of its feature rows they take)."""
        for i, image in enumerate(part.request.images):
            lo, hi = max(image.offset, part.start), min(image.end, part.start + (b - a))
            if lo < hi:
                yield (torch.arange(a + lo - part.start, a + hi - part.start), self.image_features(part.request, i),
                       slice(lo - image.offset, hi - image.offset))

    def image_cached(self, digest: bytes, salt: str | None) -> bool:
        """Whether the encoder cache holds this image for this salt now (the scheduler's encoder budget skips it)."""
        return (digest, salt) in self.encoder_cache

    def forget_images(self, request_ids) -> None:
        """Drop the features kept for requests that finished."""
        for rid in request_ids:
            self._features.pop(rid, None)
