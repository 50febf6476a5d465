"""A request's images checked against its prompt: each image preprocessed, hashed and matched, in order, with a
run of placeholder tokens of exactly its size (the prompt arrives with its placeholders expanded).

Encoded bytes seen before (``SeenImages``: the same bytes from the same tenant) are not preprocessed again here:
their digest and grid are known, and their pixels (``LazyPixels``) are computed only if the vision tower must run,
which it need not while the encoder cache holds the image's features."""

import hashlib
from collections import OrderedDict

import torch
from PIL import Image

from engine.core.prompt_images import PromptImage, placeholder_runs
from engine.vision.image_files import ImageConfig, KimiImageConfig, image_config_for  # noqa: F401 (read from here)
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
    """An image's preprocessed pixels from its encoded bytes, computed when first asked for and kept (bytes that
    were already decoded and preprocessed once, so they decode again)."""

    def __init__(self, data: bytes, config: ImageConfig, max_decoded_pixels: int) -> None:
        self._data, self._config, self._max = data, config, max_decoded_pixels
        self._pixels: ProcessedImage | None = None

    @property
    def loaded(self) -> bool:
        return self._pixels is not None

    def get(self) -> ProcessedImage:
        if self._pixels is None:
            self._pixels = _processed(self._data, self._config, self._max)
        return self._pixels


def pixels_of(pixels: ProcessedImage | LazyPixels) -> ProcessedImage:
    """What the tower reads from a ``PromptImage.pixels``."""
    return pixels.get() if isinstance(pixels, LazyPixels) else pixels


class SeenImages:
    """The digest and grid of encoded images already preprocessed, by (hash of the bytes, cache salt): an LRU of
    ``capacity`` entries (a few dozen bytes each). Salted, so how fast one tenant's image is taken never tells
    whether another tenant sent the same bytes."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[tuple[bytes, str | None], tuple[bytes, tuple[int, int, int]]] = OrderedDict()

    @staticmethod
    def key(data: bytes, salt: str | None) -> tuple[bytes, str | None]:
        return hashlib.blake2b(data, digest_size=16).digest(), salt

    def get(self, key) -> tuple[bytes, tuple[int, int, int]] | None:
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
        return found

    def put(self, key, digest_and_grid: tuple[bytes, tuple[int, int, int]]) -> None:
        self._entries[key] = digest_and_grid
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)


def attach_images(prompt_ids: list[int], images: list[ImageLike], image_token_id: int, config: ImageConfig,
                  max_decoded_pixels: int = DEFAULT_MAX_DECODED_PIXELS, seen: SeenImages | None = None,
                  salt: str | None = None) -> tuple[PromptImage, ...]:
    """The prompt's images, or ValueError naming what does not fit: an image that is not one, or placeholder runs
    that are not one per image, each as long as its image's tokens. Encoded bytes that ``seen`` holds for
    ``salt`` (the request's cache salt) get their known digest and ``LazyPixels``; others are preprocessed now
    and added to it."""
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
            pixels: ProcessedImage | LazyPixels = LazyPixels(bytes(image), config, max_decoded_pixels)
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
