"""A request's images checked against its prompt: each image preprocessed, hashed and matched, in order, with a
run of placeholder tokens of exactly its size (the prompt arrives with its placeholders expanded)."""

import hashlib

import torch
from PIL import Image

from engine.core.prompt_images import PromptImage
from engine.vision.image_files import image_config_for  # noqa: F401  (the engine reads it from here)
from engine.vision.qwen_image_processing import ProcessedImage, QwenImageConfig, decode_image, process_image

# An encoded image may decode to at most this many pixels (a decompression bomb is refused before decoding).
DEFAULT_MAX_DECODED_PIXELS = 64 * 1024 * 1024

ImageLike = bytes | Image.Image | ProcessedImage


def _processed(image: ImageLike, config: QwenImageConfig, max_decoded_pixels: int) -> ProcessedImage:
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
    return process_image(image, config)


def digest(image: ProcessedImage) -> bytes:
    """16-byte BLAKE2b of the grid and the float32 pixels: what the tower reads, whatever the file was."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(tuple(image.grid_thw)).encode())
    # the tensor's own bytes, read through numpy's buffer (no copy): iterating a torch storage into bytes goes one
    # Python call per byte, 30 s for a 448x448 image
    h.update(image.pixel_values.to(torch.float32).contiguous().numpy())
    return h.digest()


def placeholder_runs(prompt_ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of ``token_id`` in the prompt."""
    runs, i = [], 0
    while i < len(prompt_ids):
        if prompt_ids[i] == token_id:
            j = i
            while j < len(prompt_ids) and prompt_ids[j] == token_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def attach_images(prompt_ids: list[int], images: list[ImageLike], image_token_id: int, config: QwenImageConfig,
                  max_decoded_pixels: int = DEFAULT_MAX_DECODED_PIXELS) -> tuple[PromptImage, ...]:
    """The prompt's images, or ValueError naming what does not fit: an image that is not one, or placeholder runs
    that are not one per image, each as long as its image's tokens."""
    runs = placeholder_runs(prompt_ids, image_token_id)
    if len(runs) != len(images):
        raise ValueError(f"the prompt has {len(runs)} runs of image placeholder tokens (id {image_token_id}) for "
                         f"{len(images)} images")
    out = []
    for i, (image, (start, length)) in enumerate(zip(images, runs)):
        try:
            processed = _processed(image, config, max_decoded_pixels)
        except ValueError as e:
            raise ValueError(f"image {i}: {e}") from None
        _, h, w = processed.grid_thw
        rows, cols = h // config.merge_size, w // config.merge_size
        if rows * cols != length:
            raise ValueError(f"image {i} takes {rows * cols} placeholder tokens, the prompt has {length} there")
        out.append(PromptImage(start, rows, cols, digest(processed), processed))
    return tuple(out)
