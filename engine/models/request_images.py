"""What an image-reading model keeps per request and across requests: each image's features, encoded once per
request (the first time a chunk holds one of its tokens) and held until the request finishes (``forget_images``),
and the encoder cache, so an image the cache holds for the request's tenant is not encoded again
(``engine.vision.encoder_cache``). Shared by the models that take images; each says how its tower encodes one
image (``encode_pixels``)."""

from collections.abc import Iterable

from engine.core.request import Request
from engine.distributed.collectives import TensorParallel
from engine.distributed.pipeline import PipelineStage
from engine.vision.encoder_cache import EncoderCache
from engine.vision.prompt_images import pixels_of
from engine.vision.qwen3_vl_tower import VisionFeatures
from engine.vision.qwen_image_processing import ProcessedImage


class RequestImages:
    """A mixin for a model with ``takes_images``: call ``init_request_images`` in ``__init__``, define
    ``encode_pixels``, and read an image's features with ``image_features``."""

    def check_one_rank(self, tp: TensorParallel, stage: PipelineStage) -> None:
        """ValueError unless the model is served whole on one rank (call before building it): the vision tower
        and the image rows are not split across ranks or stages yet."""
        if tp.size > 1 or stage.pipelined:
            raise ValueError(f"{type(self).__name__} is served on one rank for now: tensor, expert and pipeline "
                             "parallelism are not supported with it")

    def init_request_images(self) -> None:
        self._features: dict[str, list[VisionFeatures | None]] = {}  # request id -> per image, once encoded
        # Encoded images across requests; the engine sizes it (EngineConfig.encoder_cache_gb), 0 keeps nothing.
        self.encoder_cache = EncoderCache(0)

    def encode_pixels(self, pixels: ProcessedImage) -> VisionFeatures:
        """The tower's features of one preprocessed image (on the model's device)."""
        raise NotImplementedError

    def image_features(self, request: Request, i: int) -> VisionFeatures:
        """Image ``i`` of ``request``: kept for the request, else from the encoder cache, else encoded now."""
        feats = self._features.setdefault(request.request_id, [None] * len(request.images))
        if feats[i] is None:
            image, policy = request.images[i], request.policy
            device = self.model.embed_tokens.weight.device
            feats[i] = self.encoder_cache.get(image.digest, policy.cache_salt, device)
            if feats[i] is None:
                # preprocessed now if the request came with bytes seen before
                feats[i] = self.encode_pixels(pixels_of(image.pixels))
                # held to the tenant's share of the cache (its quota's cache share, else the engine's flag)
                self.encoder_cache.put(image.digest, policy.cache_salt, feats[i], policy.tenant, policy.cache_share)
        return feats[i]

    def image_cached(self, digest: bytes, salt: str | None) -> bool:
        """Whether the encoder cache holds this image for this salt now (the scheduler's encoder budget skips it)."""
        return (digest, salt) in self.encoder_cache

    def forget_images(self, request_ids: Iterable[str]) -> None:
        """Drop the features kept for requests that finished."""
        for rid in request_ids:
            self._features.pop(rid, None)
