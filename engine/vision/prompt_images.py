"""A request's images checked against its prompt: each image preprocessed, hashed and matched, in order, with a
run of placeholder tokens of exactly its size (the prompt arrives with its placeholders expanded).

Encoded bytes seen before (``SeenImages``: the same bytes from the same tenant) are not preprocessed again here:
their digest and grid are known, and their pixels (``LazyPixels``) are computed only if the vision tower must run,
which it need not while the encoder cache holds the image's features; then on the engine's image worker
(``engine.vision.image_worker``), never on the thread that steps the engine (``pixels_ready``)."""

import hashlib
import threading
from collections import OrderedDict
from concurrent.futures import Future

import torch
from PIL import Image

from engine.core.prompt_images import PromptImage, placeholder_runs
from engine.vision.image_files import ImageConfig, KimiImageConfig, image_config_for  # noqa: F401 (read from here)
from engine.vision.image_worker import ImageWorker
from engine.vision.kimi_image_processing import process_kimi_image
from engine.vision.qwen_image_processing import ProcessedImage, decode_image, process_image

# An encoded image may decode to at most this many pixels (a decompression bomb is refused before decoding).
DEFAULT_MAX_DECODED_PIXELS = 64 * 1024 * 1024

ImageLike = bytes | Image.Image | ProcessedImage


def _processed(image: ImageLike, config: ImageConfig, max_decoded_pixels: int) -> ProcessedImage:
    if isinstance(image, ProcessedImage):
        row = 3 * config.temporal_patch_size * config.patch_size ** 2
        t, h, w = image.grid_thw
        if (t != 1 or h % config.merge_size or w % config.merge_size
                or tuple(image.pixel_values.shape) != (h * w, row)):
            raise ValueError(f"pixel values of shape {tuple(image.pixel_values.shape)} do not fit grid "
                             f"{image.grid_thw} (need [{h * w}, {row}], t 1, h and w multiples of {config.merge_size})")
        return image
    if isinstance(image, (bytes, bytearray)):
        image = decode_image(bytes(image), max_decoded_pixels)
    if not isinstance(image, Image.Image):
        raise ValueError(f"an image is bytes, a PIL image or a ProcessedImage, not {type(image).__name__}")
    return process_kimi_image(image, config) if isinstance(config, KimiImageConfig) else process_image(image, config)


def digest(image: ProcessedImage) -> bytes:
    """16-byte BLAKE2b of the grid and the float32 pixels: what the tower reads, whatever the file was."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(tuple(image.grid_thw)).encode())
    # the tensor's own bytes, read through numpy's buffer (no copy): iterating a torch storage into bytes goes one
    # Python call per byte, 30 s for a 448x448 image
    h.update(image.pixel_values.to(torch.float32).contiguous().numpy())
    return h.digest()


class LazyPixels:
    """An image's preprocessed pixels from its encoded bytes, computed once, when first asked for (bytes that were
    already decoded and preprocessed once, so they decode again). ``ready`` has them computed on ``worker`` (the
    engine's image worker) rather than on the thread that steps the engine."""

    def __init__(self, data: bytes, config: ImageConfig, max_decoded_pixels: int,
                 worker: ImageWorker | None = None) -> None:
        self._data, self._config, self._max, self._worker = data, config, max_decoded_pixels, worker
        self._pixels: ProcessedImage | None = None
        self._lock = threading.Lock()  # computed once, whichever thread asks first
        self._loading: Future | None = None

    @property
    def loaded(self) -> bool:
        return self._pixels is not None

    def get(self) -> ProcessedImage:
        with self._lock:
            if self._pixels is None:
                self._pixels = _processed(self._data, self._config, self._max)
            return self._pixels

    def ready(self) -> bool:
        """Whether ``get`` returns without preprocessing; if not, the worker starts on it (once), ahead of the
        preparation of requests queued there (``ImageWorker.submit``'s ``urgent``). Without a worker,
        always True (``get`` preprocesses on the caller's thread). A computation that failed is ready too: ``get``
        tries again and raises, rather than the image waiting forever."""
        if self._pixels is not None or self._worker is None:
            return True
        if self._loading is None:
            # urgent: the tower needs them for a request already scheduled, which must not wait for the
            # preparation of requests that arrived after it
            self._loading = self._worker.submit(self.get, urgent=True)
        return self._loading.done()


def pixels_of(pixels: ProcessedImage | LazyPixels) -> ProcessedImage:
    """What the tower reads from a ``PromptImage.pixels``."""
    return pixels.get() if isinstance(pixels, LazyPixels) else pixels


def pixels_ready(pixels: ProcessedImage | LazyPixels) -> bool:
    """Whether the tower can read a ``PromptImage.pixels`` without preprocessing them first on the calling thread;
    False starts that on the engine's image worker (``LazyPixels.ready``): ask again at a later step."""
    return not isinstance(pixels, LazyPixels) or pixels.ready()


class SeenImages:
    """The digest and grid of encoded images already preprocessed, by (hash of the bytes, cache salt): an LRU of
    ``capacity`` entries (a few dozen bytes each). Salted, so how fast one tenant's image is taken never tells
    whether another tenant sent the same bytes."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[tuple[bytes, str | None], tuple[bytes, tuple[int, int, int]]] = OrderedDict()
        self._lock = threading.Lock()  # the image worker and an offline caller's thread may both ask

    @staticmethod
    def key(data: bytes, salt: str | None) -> tuple[bytes, str | None]:
        return hashlib.blake2b(data, digest_size=16).digest(), salt

    def get(self, key) -> tuple[bytes, tuple[int, int, int]] | None:
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
            return found

    def put(self, key, digest_and_grid: tuple[bytes, tuple[int, int, int]]) -> None:
        with self._lock:
            self._entries[key] = digest_and_grid
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)


def attach_images(prompt_ids: list[int], images: list[ImageLike], image_token_id: int, config: ImageConfig,
                  max_decoded_pixels: int = DEFAULT_MAX_DECODED_PIXELS, seen: SeenImages | None = None,
                  salt: str | None = None, worker: ImageWorker | None = None) -> tuple[PromptImage, ...]:
    """The prompt's images, or ValueError naming what does not fit: an image that is not one, or placeholder runs
    that are not one per image, each as long as its image's tokens. Encoded bytes that ``seen`` holds for
    ``salt`` (the request's cache salt) get their known digest and ``LazyPixels`` (computed on ``worker`` when
    the tower needs them); others are preprocessed now, on the calling thread, and added to it."""
    runs = placeholder_runs(prompt_ids, image_token_id)
    if len(runs) != len(images):
        raise ValueError(f"the prompt has {len(runs)} runs of image placeholder tokens (id {image_token_id}) for "
                         f"{len(images)} images")
    out = []
    for i, (image, (start, length)) in enumerate(zip(images, runs)):
        key = SeenImages.key(bytes(image), salt) if seen is not None and isinstance(image, (bytes, bytearray)) \
            else None
        known = seen.get(key) if key is not None else None
        if known is not None:
            image_digest, grid = known
            pixels: ProcessedImage | LazyPixels = LazyPixels(bytes(image), config, max_decoded_pixels, worker)
        else:
            try:
                pixels = _processed(image, config, max_decoded_pixels)
            except ValueError as e:
                raise ValueError(f"image {i}: {e}") from None
            image_digest, grid = digest(pixels), tuple(pixels.grid_thw)
            if key is not None:
                seen.put(key, (image_digest, grid))
        _, h, w = grid
        rows, cols = h // config.merge_size, w // config.merge_size
        if rows * cols != length:
            raise ValueError(f"image {i} takes {rows * cols} placeholder tokens, the prompt has {length} there")
        out.append(PromptImage(start, rows, cols, image_digest, pixels))
    return tuple(out)
