"""An image file as the gateway and the engine first read it, torch-free: the Qwen-VL processor's settings, the
size ``smart_resize`` picks (so an image's token count is known before its pixels are processed), and the first
frame decoded with decompression bombs refused from the header."""

import dataclasses
import io
import json
import math
import os

from PIL import Image


@dataclasses.dataclass(frozen=True)
class QwenImageConfig:
    """The processor's settings, read from ``preprocessor_config.json`` (defaults: Qwen3-VL's)."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536
    max_pixels: int = 16777216
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    @classmethod
    def from_dict(cls, raw: dict) -> "QwenImageConfig":
        """The settings a ``preprocessor_config.json`` holds; ``size``'s edges or ``min/max_pixels`` bound the area."""
        size = raw.get("size") or {}
        fields = {f.name: raw[f.name] for f in dataclasses.fields(cls) if raw.get(f.name) is not None}
        if size.get("shortest_edge") is not None:
            fields.setdefault("min_pixels", size["shortest_edge"])
        if size.get("longest_edge") is not None:
            fields.setdefault("max_pixels", size["longest_edge"])
        for key in ("image_mean", "image_std"):
            if key in fields:
                fields[key] = tuple(float(v) for v in fields[key])
        return cls(**fields)

    @property
    def factor(self) -> int:
        """Both sides of a resized image are multiples of this: one merge window of patches."""
        return self.patch_size * self.merge_size


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) an image is resized to: multiples of ``factor``, area within the bounds, aspect kept.

    Raises ValueError for an aspect ratio over 200 (Qwen's own limit)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.1f} is over 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class PixelLimitError(ValueError):
    """An image that would decode to more pixels than allowed."""


def decode_image(data: bytes, max_pixels: int) -> Image.Image:
    """The first frame of an encoded image, fully decoded; ValueError for bytes that are not an image or that
    would decode to more than ``max_pixels`` (a decompression bomb is refused before its pixels are read)."""
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:  # Pillow's own header check, past twice its MAX_IMAGE_PIXELS
        raise PixelLimitError(f"image over the pixel limit ({exc})") from None
    except Exception as exc:  # Pillow raises several types for undecodable bytes
        raise ValueError("not an image Pillow can read") from exc
    width, height = image.size
    if width * height > max_pixels:
        raise PixelLimitError(f"image of {width}x{height} pixels is over the limit of {max_pixels:,}")
    try:
        image.seek(0)
        image.load()
    except Exception as exc:
        raise ValueError("image data is truncated or corrupt") from exc
    return image


def image_config_for(model_dir: str, vision_config) -> QwenImageConfig:
    """The checkpoint's ``preprocessor_config.json`` settings; without one, Qwen3-VL's defaults with the vision
    tower's own patch, frame and merge sizes (``vision_config``: its attributes)."""
    path = os.path.join(model_dir, "preprocessor_config.json")
    raw = {}
    if os.path.exists(path):
        with open(path) as f:
            raw = json.load(f)
    for key, source in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                        ("merge_size", "spatial_merge_size")):
        raw.setdefault(key, getattr(vision_config, source))
    return QwenImageConfig.from_dict(raw)
