"""Qwen-VL preprocessing without torchvision: bit-equal to transformers' PIL-backed Qwen2-VL image processor (the
class Qwen3-VL checkpoints name) on random images of several sizes, modes and file formats."""

import io

import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from engine.vision.qwen_image_processing import QwenImageConfig, decode_image, process_image

# Qwen3-VL's settings, with a small pixel budget so that images both grow (min) and shrink (max)
RAW = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
       "image_std": [0.5, 0.5, 0.5], "size": {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 24}}


def _random_image(gen: torch.Generator, mode: str, size: tuple[int, int]) -> Image.Image:
    w, h = size
    bands = {"RGB": 3, "RGBA": 4, "L": 1, "LA": 2}[mode]
    data = torch.randint(0, 256, (h, w, bands), generator=gen, dtype=torch.uint8)
    return Image.frombytes(mode, (w, h), bytes(data.flatten().tolist()))


def _encoded(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _cases(gen: torch.Generator):
    yield "rgb", _random_image(gen, "RGB", (97, 61))  # grows to the minimum area
    yield "rgba", _random_image(gen, "RGBA", (300, 170))  # shrinks to the maximum area; alpha on white
    yield "l", _random_image(gen, "L", (64, 129))
    yield "la", _random_image(gen, "LA", (45, 150))
    # a palette GIF with a transparent index: its first frame, composited on white
    frames = [_random_image(gen, "RGB", (120, 88)).quantize(16) for _ in range(2)]
    gif = _encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], transparency=3)
    yield "gif", decode_image(gif, max_pixels=10**6)
    yield "webp", decode_image(_encoded(_random_image(gen, "RGB", (150, 100)), "WEBP", quality=80), max_pixels=10**6)
    yield "png_rgba", decode_image(_encoded(_random_image(gen, "RGBA", (33, 77)), "PNG"), max_pixels=10**6)


def test_bit_equal_to_transformers():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    config = QwenImageConfig.from_dict(RAW)
    reference = Qwen2VLImageProcessorPil(**RAW)
    grids = set()
    for name, image in _cases(gen):
        ours = process_image(image, config)
        theirs = reference(images=[image], return_tensors="pt")
        assert ours.pixel_values.dtype == torch.float32, name
        assert torch.equal(ours.pixel_values, theirs["pixel_values"]), name
        assert list(ours.grid_thw) == theirs["image_grid_thw"][0].tolist(), name
        assert ours.num_tokens(config.merge_size) == ours.pixel_values.shape[0] // 4
        grids.add(ours.grid_thw)
    assert len(grids) >= 5  # the sizes really differ


def test_decode_refuses_bombs_and_garbage():
    big = _encoded(Image.new("L", (2000, 2000)), "PNG")
    with pytest.raises(ValueError, match="over the limit"):
        decode_image(big, max_pixels=1000 * 1000)
    with pytest.raises(ValueError, match="not an image"):
        decode_image(b"definitely not an image", max_pixels=10**6)
    with pytest.raises(ValueError, match="truncated|not an image"):
        decode_image(big[: len(big) // 2], max_pixels=10**7)


def test_aspect_ratio_over_200_refused():
    with pytest.raises(ValueError, match="aspect ratio"):
        process_image(Image.new("RGB", (1000, 4)), QwenImageConfig.from_dict(RAW))
