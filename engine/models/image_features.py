"""What every model that reads images does with them per request (Qwen3-VL-MoE, Qwen3.5-MoE, Kimi-K2.5): each
image is encoded once per request, the first time a step's chunk holds one of its placeholder tokens, and its
features kept until the request finishes (``forget_images``); an image the encoder cache holds for the request's
tenant is not encoded again (``engine.vision.encoder_cache``). With layer-chunked encoding
(``engine.core.encoder_pieces``) the scheduler has the tower run an image a few blocks a step (``encode_pieces``,
before the step's forward): the image's state is kept here between steps, and its features exist (and enter the
encoder cache) only once its last block and the merger have run.

Under tensor parallelism rank 0 alone does this: it holds the requests, the vision tower and the encoder cache, and
hands each step's image rows to the other ranks (``engine.models.image_step``), which build no tower and read none
of its tensors."""

import abc
from collections.abc import Iterator

import torch
from torch import nn

from engine.core.encoder_pieces import EncoderPiece
from engine.core.prompt_images import PromptImage
from engine.core.request import Request
from engine.core.scheduler import ScheduledRequest
from engine.distributed.collectives import TensorParallel
from engine.distributed.pipeline import PipelineStage
from engine.models.image_step import ImageStep, share_image_step
from engine.vision.encoder_cache import EncoderCache
from engine.vision.prompt_images import pixels_of, pixels_ready
from engine.vision.qwen_image_processing import ProcessedImage
from engine.vision.qwen3_vl_tower import VisionFeatures
from engine.vision.tower_rows import TowerState


class ImageFeatures(abc.ABC):
    """Mixed into a model class; its ``__init__`` calls ``init_image_features`` and it says how an image is
    encoded (``encode``)."""

    # Our names' prefixes of the tower's parameters (and its projector's): rank 0's alone.
    tower_names: tuple[str, ...] = ()
    # Whether the model's image steps carry their own positions (Qwen's M-RoPE: [3, T]).
    step_positions = False

    def check_image_split(self, architecture: str, tp: TensorParallel, stage: PipelineStage) -> None:
        """ValueError for a split the image rows are not carried through (call before building the model):
        pipeline stages and expert parallelism. Tensor parallelism is served: the text model split as its
        family's, the tower on rank 0."""
        if stage.pipelined or tp.expert_parallel is not None:
            raise ValueError(f"{architecture} with images is not served with pipeline or expert parallelism yet")

    @property
    def holds_tower(self) -> bool:
        """Whether this rank encodes images (rank 0 of its tensor-parallel group) rather than receiving them."""
        return self.tp.rank == 0

    def on_other_stage(self, name: str) -> bool:
        """The tower's tensors are read by rank 0 alone; otherwise the family's rule (pipeline stages)."""
        if not self.holds_tower and self.map_weight_name(name)[0].startswith(self.tower_names):
            return True
        return super().on_other_stage(name)

    def init_image_features(self) -> None:
        self._features: dict[str, list[VisionFeatures | None]] = {}
        # Images part-way through the tower (layer-chunked encoding), by (request id, image index): rank 0's only.
        self._partial: dict[tuple[str, int], TowerState] = {}
        # Encoded images across requests; the engine sizes it (EngineConfig.encoder_cache_gb), 0 keeps nothing.
        self.encoder_cache = EncoderCache(0)

    @abc.abstractmethod
    def local_image_step(self, scheduled: list[ScheduledRequest], ranges: tuple[tuple[int, int], ...],
                         num_rows: int, device: torch.device) -> ImageStep:
        """Rank 0: the step's image rows and features (and positions, ``step_positions``) from its parts."""

    @torch.inference_mode()
    def image_step(self, scheduled: list[ScheduledRequest], ranges: tuple[tuple[int, int], ...],
                   num_rows: int, device: torch.device) -> ImageStep:
        """A forward's image work from the step's parts (``ranges``: their flat rows, in the same order; the runner
        calls it on every rank, each with the same parts): rank 0's, built there and received by the others."""
        step = self.local_image_step(scheduled, ranges, num_rows, device) if self.holds_tower else None
        return share_image_step(self.tp, step, num_rows, self.step_positions, self.config.hidden_size,
                                self.model.embed_tokens.weight.dtype, device)

    # Layer-chunked encoding (``encode_pieces``): each model that reads images defines these four.
    @property
    @abc.abstractmethod
    def encoder_shape(self) -> tuple[int, int]:
        """(the tower's stages: its patch embedding then each block, patches an image token merges): what
        layer-chunked encoding counts."""

    @property
    @abc.abstractmethod
    def tower_block(self) -> nn.Module:
        """One block of the vision tower (rank 0's): the unit the default layer-chunked budget is counted in
        (``engine.models.encoder_budget``)."""

    @abc.abstractmethod
    def begin_encoding(self, pixels: ProcessedImage) -> TowerState:
        """One image's state before the tower's first stage (``engine.vision.tower_rows``)."""

    @abc.abstractmethod
    def encode_passes(self, state: TowerState, first: int, end: int) -> None:
        """Passes ``first..end-1`` of the tower over ``state``, in place (``engine.vision.tower_rows``: a stage
        is two passes over each of the image's rows)."""

    @abc.abstractmethod
    def finish_encoding(self, state: TowerState) -> VisionFeatures:
        """The features, one row per placeholder token, of an image whose state has run every block."""

    @abc.abstractmethod
    def encode(self, pixels: ProcessedImage) -> VisionFeatures:
        """One image's features, one row per placeholder token: the whole tower in one go."""

    @torch.inference_mode()
    def encode_pieces(self, pieces: list[EncoderPiece]) -> None:
        """Rank 0, before a step's forward: run each piece's passes over its image's kept state (the first begins
        it: pixels prepared off the step loop, ``image_ready``; stage 0 is the patch embedding, stage ``s`` block
        ``s - 1``, each split into passes over the image's rows: ``engine.vision.tower_rows``); a piece that ends
        at the last pass finishes the image, which is then kept for its request and put in the encoder cache, as
        a whole image is; a piece of every pass runs the tower unsplit (``encode``)."""
        for piece in pieces:
            request, i = piece.request, piece.image
            key = (request.request_id, i)
            if piece.first == 0:
                self.encoder_cache.misses += 1  # planned because the cache did not hold it
            if piece.first == 0 and piece.end == piece.total:
                done = self.encode(pixels_of(request.images[i].pixels))  # the whole tower this step: unsplit
            else:
                if piece.first == 0:
                    self._partial[key] = self.begin_encoding(pixels_of(request.images[i].pixels))
                state = self._partial[key]
                self.encode_passes(state, piece.first, piece.end)
                if piece.end < piece.total:
                    continue
                done = self.finish_encoding(self._partial.pop(key))
            self._features.setdefault(request.request_id, [None] * len(request.images))[i] = done
            image, policy = request.images[i], request.policy
            self.encoder_cache.put(image.digest, policy.cache_salt, done, policy.tenant, policy.cache_share)

    def take_cached(self, parts: list[ScheduledRequest], pieces: list[EncoderPiece]) -> None:
        """Rank 0, before a step's ``pieces``: the features the step's chunks read from the encoder cache, kept
        for their requests now, so that the features the pieces put in the cache cannot evict them first (the
        forward would then run the whole tower over them, past the step's encoder budget)."""
        encoding = {(p.request.request_id, p.image) for p in pieces}
        for part in parts:
            request = part.request
            if request is None or not request.images:
                continue
            for i, image in enumerate(request.images):
                if image.offset < part.start + part.num_new_tokens and image.end > part.start \
                        and (request.request_id, i) not in encoding \
                        and (image.digest, request.policy.cache_salt) in self.encoder_cache:
                    self._from_cache(request, i)

    def _from_cache(self, request: Request, i: int) -> VisionFeatures | None:
        """Image ``i`` of ``request``: kept for the request, else read from the encoder cache (None: it misses)."""
        feats = self._features.setdefault(request.request_id, [None] * len(request.images))
        if feats[i] is None:
            # a part-way state left over (the cache came to hold the image meanwhile): the cache's is used
            self._partial.pop((request.request_id, i), None)
            image, policy = request.images[i], request.policy
            feats[i] = self.encoder_cache.get(image.digest, policy.cache_salt, self.model.embed_tokens.weight.device)
        return feats[i]

    def image_features(self, request: Request, i: int) -> VisionFeatures:
        """Image ``i`` of ``request``: kept for the request, else from the encoder cache, else encoded now."""
        feats = self._from_cache(request, i)
        if feats is None:
            image, policy = request.images[i], request.policy
            # its pixels are ready (the scheduler waited for them: ``image_ready``), unless the cache held the
            # image when the step was planned and dropped it since (then they are preprocessed here)
            feats = self._features[request.request_id][i] = self.encode(pixels_of(image.pixels))
            # held to the tenant's share of the cache (its quota's cache share, else the engine's flag)
            self.encoder_cache.put(image.digest, policy.cache_salt, feats, policy.tenant, policy.cache_share)
        return feats

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

    def image_ready(self, image: PromptImage) -> bool:
        """Whether the tower can read this image's pixels now; False: they are being preprocessed on the engine's
        image worker (bytes seen before, left lazy: ``engine.vision.prompt_images``), and the scheduler has the
        image wait, so the step loop never decodes one."""
        return pixels_ready(image.pixels)

    def forget_images(self, request_ids) -> None:
        """Drop the features kept for requests that finished."""
        for rid in request_ids:
            self._features.pop(rid, None)
        if self._partial:
            gone = set(request_ids)
            for key in [k for k in self._partial if k[0] in gone]:
                del self._partial[key]
