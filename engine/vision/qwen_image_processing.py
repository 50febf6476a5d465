"""Qwen-VL image preprocessing with Pillow and torch only (torchvision's CPU build does not install here).

The result is bit-equal to transformers' PIL-backed Qwen2-VL image processor, which Qwen2-VL, Qwen2.5-VL and
Qwen3-VL(-MoE) checkpoints name: transparency composited onto white, a bicubic Pillow resize to the size
``smart_resize`` picks, ``x * (1/255)`` in float64 then float32, ``(x - mean) / std`` in float32, and the patch
layout the vision tower's Conv3d and its 2x2 merger read (each merge window's patches consecutive).
"""

import dataclasses
import io
import math

import torch
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


@dataclasses.dataclass(frozen=True)
class ProcessedImage:
    """One image as the vision tower reads it."""

    pixel_values: torch.Tensor  # [grid_h * grid_w, 3 * temporal_patch_size * patch_size**2] float32
    grid_thw: tuple[int, int, int]  # (1, grid_h, grid_w) in patches

    def num_tokens(self, merge_size: int) -> int:
        """Placeholder tokens the image takes in the prompt: one per merge window."""
        t, h, w = self.grid_thw
        return t * h * w // (merge_size * merge_size)


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


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency (an alpha band or a palette's transparent index) composited onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _pil_to_chw(image: Image.Image) -> torch.Tensor:
    """[3, H, W] uint8 from an RGB image (no numpy: the bytes are read as they lie, row-major HWC)."""
    w, h = image.size
    hwc = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(h, w, 3)
    return hwc.permute(2, 0, 1)


def patchify(chw: torch.Tensor, config: QwenImageConfig) -> tuple[torch.Tensor, int, int]:
    """[C, H, W] -> [grid_h * grid_w, C * T * P * P], the patches of each merge window consecutive.

    A still image fills the temporal axis by repeating itself (the tower's Conv3d reads T frames)."""
    c, height, width = chw.shape
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    grid_h, grid_w = height // p, width // p
    # [C, gh/m, m, P, gw/m, m, P] -> [gh/m, gw/m, m, m, C, P, P]
    x = chw.reshape(c, grid_h // m, m, p, grid_w // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    x = x.unsqueeze(5).expand(*x.shape[:5], t, p, p)  # [gh/m, gw/m, m, m, C, T, P, P]
    return x.reshape(grid_h * grid_w, c * t * p * p), grid_h, grid_w


def process_image(image: Image.Image, config: QwenImageConfig) -> ProcessedImage:
    """One decoded image -> its patches and grid. Raises ValueError for an aspect ratio Qwen refuses."""
    rgb = to_rgb(image)
    width, height = rgb.size
    new_h, new_w = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
    resized = rgb.resize((new_w, new_h), resample=Image.Resampling.BICUBIC)
    chw = _pil_to_chw(resized)
    # float64 then float32, as transformers' rescale does, so every value rounds the same way
    x = (chw.to(torch.float64) * config.rescale_factor).to(torch.float32)
    mean = torch.tensor(config.image_mean, dtype=torch.float32).view(3, 1, 1)
    std = torch.tensor(config.image_std, dtype=torch.float32).view(3, 1, 1)
    x = (x - mean) / std
    patches, grid_h, grid_w = patchify(x, config)
    return ProcessedImage(pixel_values=patches.contiguous(), grid_thw=(1, grid_h, grid_w))


def decode_image(data: bytes, max_pixels: int) -> Image.Image:
    """The first frame of an encoded image, fully decoded; ValueError for bytes that are not an image or that
    would decode to more than ``max_pixels`` (a decompression bomb is refused before its pixels are read)."""
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:  # Pillow's own header check, past twice its MAX_IMAGE_PIXELS
        raise ValueError(f"image over the pixel limit ({exc})") from None
    except Exception as exc:  # Pillow raises several types for undecodable bytes
        raise ValueError("not an image Pillow can read") from exc
    width, height = image.size
    if width * height > max_pixels:
        raise ValueError(f"image of {width}x{height} pixels is over the limit of {max_pixels}")
    try:
        image.seek(0)
        image.load()
    except Exception as exc:
        raise ValueError("image data is truncated or corrupt") from exc
    return image
