"""A tiny random Kimi-K2.5 checkpoint (transformers' ``Kimi_K25ForConditionalGeneration``, every parameter drawn
at random, saved in the published layout as ``save_pretrained`` writes it) and a reference for its image
preprocessing.

transformers' Kimi-K2.5 image processor runs only on torchvision, which does not install beside this torch. The
reference here re-derives its steps: transformers' own ``navit_resize`` (read from its source file, which cannot
be imported without torchvision) and RGB conversion; the resize as torchvision's ``resize_image`` does it for a
uint8 image on the CPU (one ``torch.nn.functional.interpolate`` call, bicubic, antialiased, skipped when the size
does not change); zero padding; the fused rescale and normalise computed in float64 from the processor's float32
constants (each float32 step rounded once); and the patches cut one by one.
"""

import ast
import json
import math
import os

import numpy as np
import torch
import transformers
from PIL import Image
from torch.nn import functional as F
from transformers import AutoConfig, Kimi_K25ForConditionalGeneration
from transformers.image_transforms import convert_to_rgb

from engine.vision.image_files import KimiImageConfig
from tests.hf_models import FAMILY_CONFIGS, randomize_constants_

VOCAB = 211
# the video placeholder past the vocabulary, as Kimi-K2.5's is (163840 in a vocabulary of 163840): transformers
# embeds it as token 0 wherever it stands, so a model that could sample it would be read back differently
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 200, VOCAB, 198, 199
# 4-pixel patches merged 2x2; at most 24 patches (8 a side) before padding to whole windows: 1..16 tokens an image
IMAGE_CONFIG = KimiImageConfig(patch_size=4, merge_size=2, max_patches=24, max_size_per_side=8,
                               image_mean=(0.48145466, 0.4578275, 0.40821073),
                               image_std=(0.26862954, 0.26130258, 0.27577711))


def make_kimi_k25(path: str, seed: int, **text_overrides):
    """MoonViT of 2 blocks, width 32 (2 heads of 16), a 6x6 learned position grid; DeepSeek-V3's text model of 2
    layers (MLA, grouped sigmoid routing, a dense first layer; ``text_overrides`` change its settings). The LM head
    untied. Saved to ``path`` with the processor settings in ``preprocessor_config.json``; returns the transformers
    model (eval, float32)."""
    text = {**FAMILY_CONFIGS["deepseek_v3"], "initializer_range": 0.08, **text_overrides}
    config = AutoConfig.for_model(
        "kimi_k25",
        text_config=dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=1024, eos_token_id=VOCAB - 1,
                         bos_token_id=None, pad_token_id=0, **text),
        vision_config=dict(patch_size=4, pos_emb_height=6, pos_emb_width=6, pos_emb_time=4, num_attention_heads=2,
                           num_hidden_layers=2, hidden_size=32, intermediate_size=48, merge_kernel_size=[2, 2],
                           rope_parameters=dict(rope_type="axial", rope_theta=10000.0), initializer_range=0.08),
        projection_hidden_size=32, image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Kimi_K25ForConditionalGeneration(config).to(torch.float32).eval()
    randomize_constants_(model, torch.Generator().manual_seed(seed))
    model.save_pretrained(path)
    c = IMAGE_CONFIG
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump({"image_processor_type": "Kimi_K25ImageProcessor", "patch_size": c.patch_size,
                   "merge_size": c.merge_size, "max_patches": c.max_patches,
                   "size": {"max_height": c.max_size_per_side, "max_width": c.max_size_per_side},
                   "image_mean": list(c.image_mean), "image_std": list(c.image_std)}, f)
    return model


def random_image(gen: torch.Generator, width: int, height: int) -> Image.Image:
    data = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
    return Image.frombytes("RGB", (width, height), bytes(data.flatten().tolist()))


def transformers_navit_resize():
    """transformers' ``navit_resize``, taken from its source file (the module imports torchvision at the top)."""
    path = os.path.join(os.path.dirname(transformers.__file__), "models", "kimi_k25", "image_processing_kimi_k25.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "navit_resize")
    namespace = {"math": math}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), path, "exec"), namespace)
    return namespace["navit_resize"]


def reference_pixels(image: Image.Image, c: KimiImageConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """[L, 3 * P * P] float32 patches (row-major over the grid) and the grid, derived step by step."""
    navit = transformers_navit_resize()
    width, height = image.size
    (new_h, new_w), (pad_h, pad_w) = navit(height, width, patch_size=c.patch_size, merge_kernel_size=c.merge_size,
                                           max_patches=c.max_patches, max_size_per_side=c.max_size_per_side)
    hwc = convert_to_rgb(image, return_numpy=True)  # transformers' own (transparency onto white)
    chw = torch.from_numpy(hwc).permute(2, 0, 1).contiguous()  # as its torchvision backend lays the image out
    if (new_h, new_w) != tuple(chw.shape[1:]):
        chw = F.interpolate(chw[None], size=[new_h, new_w], mode="bicubic", align_corners=False, antialias=True)[0]
    padded = np.zeros((pad_h, pad_w, 3), dtype=np.float64)
    padded[:new_h, :new_w] = chw.permute(1, 2, 0).numpy()
    # the processor's constants: float32 mean and std times 1 / rescale_factor, in float32
    mean = (np.array(c.image_mean, dtype=np.float32) * np.float32(1.0 / c.rescale_factor)).astype(np.float64)
    std = (np.array(c.image_std, dtype=np.float32) * np.float32(1.0 / c.rescale_factor)).astype(np.float64)
    # each float32 step (the difference, then the quotient) rounded once from its exact float64 value
    normed = ((padded - mean).astype(np.float32).astype(np.float64) / std).astype(np.float32)
    p = c.patch_size
    rows = [normed[r * p:(r + 1) * p, q * p:(q + 1) * p].transpose(2, 0, 1).reshape(-1)
            for r in range(pad_h // p) for q in range(pad_w // p)]
    return torch.from_numpy(np.stack(rows)), (1, pad_h // p, pad_w // p)
