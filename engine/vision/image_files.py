"""An image file as the gateway and the engine first read it, torch-free: the image processor's settings (Qwen-VL's
or Kimi-K2.5's), the size each resizes an image to (``smart_resize``, ``navit_resize``: so an image's token count
is known before its pixels are processed), and the first frame decoded with decompression bombs refused from the
header."""

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

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(grid_h, grid_w) in patches of an image of this size. ValueError for an aspect ratio Qwen refuses."""
        new_h, new_w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return new_h // self.patch_size, new_w // self.patch_size


@dataclasses.dataclass(frozen=True)
class KimiImageConfig:
    """Kimi-K2.5's image processor settings (MoonViT: 14-pixel patches, 2x2 merge windows, at most ``max_patches``
    patches and ``max_size_per_side`` patches a side), read from ``preprocessor_config.json``."""

    patch_size: int = 14
    merge_size: int = 2
    max_patches: int = 16384
    max_size_per_side: int = 512  # in patches: the processor's ``size["max_height"]``
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    # one frame per patch: a still image's rows are 3 * patch_size**2 values (Qwen's repeat it over 2 frames)
    temporal_patch_size = 1

    @classmethod
    def from_dict(cls, raw: dict) -> "KimiImageConfig":
        """transformers' keys (``size.max_height``, ``max_patches``, ``merge_size``), or the original remote-code
        processor's ``media_proc_cfg`` (``in_patch_limit``, ``patch_limit_on_one_side``, ``merge_kernel_size``)."""
        raw = {**(raw.get("media_proc_cfg") or {}), **raw}
        fields = {f.name: raw[f.name] for f in dataclasses.fields(cls) if raw.get(f.name) is not None}
        for key, ours in (("in_patch_limit", "max_patches"), ("patch_limit_on_one_side", "max_size_per_side"),
                          ("merge_kernel_size", "merge_size")):
            if raw.get(key) is not None:
                value = raw[key]
                fields.setdefault(ours, value[0] if isinstance(value, (list, tuple)) else value)
        size = raw.get("size") or {}
        if size.get("max_height") is not None:
            if size.get("max_width") not in (None, size["max_height"]):
                raise ValueError(f"size {size}: max_height and max_width must be equal")
            fields.setdefault("max_size_per_side", size["max_height"])
        for key in ("image_mean", "image_std"):
            if key in fields:
                fields[key] = tuple(float(v) for v in fields[key])
        return cls(**{k: int(v) if k in ("patch_size", "merge_size", "max_patches", "max_size_per_side") else v
                      for k, v in fields.items()})

    def sizes(self, height: int, width: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """((resized h, w), (padded h, w)) for an image of this size (``navit_resize``)."""
        return navit_resize(height, width, self.patch_size, self.merge_size, self.max_patches,
                            self.max_size_per_side)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(grid_h, grid_w) in patches of an image of this size: its padded size over the patch size."""
        _, (pad_h, pad_w) = self.sizes(height, width)
        return pad_h // self.patch_size, pad_w // self.patch_size


def navit_resize(height: int, width: int, patch_size: int, merge_size: int, max_patches: int,
                 max_size_per_side: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Kimi-K2.5's sizes for an image: scaled down (never up, aspect kept) to at most ``max_patches`` patches and
    ``max_size_per_side`` patches a side, then padded (bottom and right) to whole merge windows. The arithmetic is
    transformers' ``navit_resize``, step for step (float patch counts, ``int()`` truncation)."""
    patches_h = max(1.0, height // patch_size)
    patches_w = max(1.0, width // patch_size)
    scale = min(1.0, math.sqrt(max_patches / (patches_h * patches_w)), (max_size_per_side * patch_size) / height,
                (max_size_per_side * patch_size) / width)
    new_h, new_w = max(1, int(height * scale)), max(1, int(width * scale))
    new_h, new_w = min(new_h, max_size_per_side * patch_size), min(new_w, max_size_per_side * patch_size)
    factor = merge_size * patch_size
    return (new_h, new_w), ((factor - new_h % factor) % factor + new_h, (factor - new_w % factor) % factor + new_w)


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


ImageConfig = QwenImageConfig | KimiImageConfig


def is_kimi_vision(vision_config) -> bool:
    """Whether a vision config is MoonViT's (Kimi-K2.5: ``merge_kernel_size``; Qwen's say ``spatial_merge_size``)."""
    return getattr(vision_config, "model_type", None) == "kimi_k25_vision" or \
        getattr(vision_config, "merge_kernel_size", None) is not None


def image_config_for(model_dir: str, vision_config) -> ImageConfig:
    """The checkpoint's ``preprocessor_config.json`` settings; without one, the processor's defaults with the vision
    tower's own patch, frame and merge sizes (``vision_config``: its attributes)."""
    path = os.path.join(model_dir, "preprocessor_config.json")
    raw = {}
    if os.path.exists(path):
        with open(path) as f:
            raw = json.load(f)
    if is_kimi_vision(vision_config):
        raw = {**(raw.get("media_proc_cfg") or {}), **raw}
        raw.setdefault("patch_size", getattr(vision_config, "patch_size", 14))
        merge = getattr(vision_config, "merge_kernel_size", None) or (2, 2)
        if merge[0] != merge[1]:
            raise ValueError(f"merge_kernel_size {list(merge)}: only square merge windows are supported")
        if raw.get("merge_kernel_size") is None:
            raw.setdefault("merge_size", merge[0])
        return KimiImageConfig.from_dict(raw)
    for key, source in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                        ("merge_size", "spatial_merge_size")):
        raw.setdefault(key, getattr(vision_config, source))
    return QwenImageConfig.from_dict(raw)
