"""Kimi-K2.5 image preprocessing with Pillow and torch only (torchvision's CPU build does not install here).

transformers' ``Kimi_K25ImageProcessor`` exists only on its torchvision backend. Its steps on the CPU, done here
with the same torch kernels: transparency composited onto white; an antialiased bicubic resize of the uint8
image to the size ``navit_resize`` picks (torchvision's ``resize`` calls ``torch.nn.functional.interpolate`` on
uint8 images on the CPU, the kernel used here); zero padding at the bottom and right to whole merge windows; a
fused rescale and normalise in float32 (``(x - mean / rescale) / (std / rescale)``, the constants float32 as
torch makes them); and one row per 14x14 patch in row-major order over the grid (MoonViT's merger finds each
2x2 window itself).
"""

import torch
from torch.nn import functional as F
from PIL import Image

from engine.vision.image_files import KimiImageConfig
from engine.vision.qwen_image_processing import ProcessedImage, _pil_to_chw, to_rgb


def resize_uint8(chw: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[3, H, W] uint8 -> [3, height, width] uint8: bicubic with antialiasing, as torchvision resizes on the CPU."""
    if tuple(chw.shape[1:]) == (height, width):
        return chw
    return F.interpolate(chw[None], size=(height, width), mode="bicubic", align_corners=False, antialias=True)[0]


def kimi_patchify(chw: torch.Tensor, patch_size: int) -> tuple[torch.Tensor, int, int]:
    """[C, H, W] -> [grid_h * grid_w, C * P * P], patches row-major over the grid (each row is C x P x P)."""
    c, height, width = chw.shape
    p = patch_size
    grid_h, grid_w = height // p, width // p
    x = chw.reshape(c, grid_h, p, grid_w, p).permute(1, 3, 0, 2, 4)  # [gh, gw, C, P, P]
    return x.reshape(grid_h * grid_w, c * p * p), grid_h, grid_w


def process_kimi_image(image: Image.Image, config: KimiImageConfig) -> ProcessedImage:
    """One decoded image -> its patches and grid (1, grid_h, grid_w)."""
    chw = _pil_to_chw(to_rgb(image))
    (new_h, new_w), (pad_h, pad_w) = config.sizes(chw.shape[1], chw.shape[2])
    resized = resize_uint8(chw.contiguous(), new_h, new_w)
    padded = F.pad(resized, (0, pad_w - new_w, 0, pad_h - new_h), value=0)
    # the processor fuses rescale into normalise: mean and std over the rescale factor, float32 tensors
    mean = torch.tensor(config.image_mean, dtype=torch.float32) * (1.0 / config.rescale_factor)
    std = torch.tensor(config.image_std, dtype=torch.float32) * (1.0 / config.rescale_factor)
    x = (padded.to(torch.float32) - mean.view(3, 1, 1)) / std.view(3, 1, 1)
    patches, grid_h, grid_w = kimi_patchify(x, config.patch_size)
    return ProcessedImage(pixel_values=patches.contiguous(), grid_thw=(1, grid_h, grid_w))
