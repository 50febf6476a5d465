"""Qwen-VL image preprocessing with Pillow and torch only (torchvision's CPU build does not install here).

The result is bit-equal to transformers' PIL-backed Qwen2-VL image processor, which Qwen2-VL, Qwen2.5-VL and
Qwen3-VL(-MoE) checkpoints name: transparency composited onto white, a bicubic Pillow resize to the size
``smart_resize`` picks, ``x * (1/255)`` in float64 then float32, ``(x - mean) / std`` in float32, and the patch
layout the vision tower's Conv3d and its 2x2 merger read (each merge window's patches consecutive).
"""

import dataclasses

import torch
from PIL import Image

# The torch-free parts (the gateway reads them too), named here as well, where they have always been.
from engine.vision.image_files import QwenImageConfig, decode_image, smart_resize  # noqa: F401


@dataclasses.dataclass(frozen=True)
class ProcessedImage:
    """One image as the vision tower reads it."""

    pixel_values: torch.Tensor  # [grid_h * grid_w, 3 * temporal_patch_size * patch_size**2] float32
    grid_thw: tuple[int, int, int]  # (1, grid_h, grid_w) in patches

    def num_tokens(self, merge_size: int) -> int:
        """Placeholder tokens the image takes in the prompt: one per merge window."""
        t, h, w = self.grid_thw
        return t * h * w // (merge_size * merge_size)


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
