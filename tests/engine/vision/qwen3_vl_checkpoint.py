"""A tiny random Qwen3-VL-MoE checkpoint (transformers' ``Qwen3VLMoeForConditionalGeneration``, every parameter
drawn at random), random images and prompts for it, and transformers' greedy tokens: the reference the vision tests
compare against. ``tests/conftest.py``'s session fixture ``qwen3_vl_checkpoint`` builds one for every test file
that reads it."""

import json

import torch
from PIL import Image
from transformers import AutoConfig

from engine.vision.qwen3_vl_tower import Qwen3VisionTower, VisionConfig
from engine.vision.qwen_image_processing import QwenImageConfig
from tests.hf_models import save_random_image_text_model, tiny_text_config

VOCAB = 211
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 200, 201, 198, 199
# 4-pixel patches merged 2x2: each placeholder token is an 8x8 pixel window; 2..12 tokens an image
IMAGE_CONFIG = QwenImageConfig(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=8 * 8 * 2,
                               max_pixels=8 * 8 * 12)


def make_qwen3_vl_moe(path: str, seed: int):
    """Vision depth 2 (both blocks tapped for deepstack), width 32; text 2 layers of width 32, 4 experts (top 2),
    interleaved M-RoPE over 8 frequencies. The LM head is untied as the whole config says, while its text config
    keeps its default (tied): the engine must read the whole model's. Saved to ``path``; returns the transformers model (eval, float32)."""
    config = AutoConfig.for_model(
        "qwen3_vl_moe",
        text_config=tiny_text_config(VOCAB, hidden_size=32, intermediate_size=40, num_attention_heads=2,
                                     num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=16, decoder_sparse_step=1,
                                     rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                          mrope_section=[4, 2, 2], mrope_interleaved=True)),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=32,
                           patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16,
                           deepstack_visual_indexes=[0, 1], initializer_range=0.08),
        image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, tie_word_embeddings=False,
    )
    return save_random_image_text_model(config, path, seed)


def write_preprocessor_config(path: str) -> None:
    """``IMAGE_CONFIG`` as the checkpoint's ``preprocessor_config.json``: the settings the engine preprocesses with."""
    with open(f"{path}/preprocessor_config.json", "w") as f:
        json.dump({"patch_size": IMAGE_CONFIG.patch_size, "temporal_patch_size": IMAGE_CONFIG.temporal_patch_size,
                   "merge_size": IMAGE_CONFIG.merge_size, "image_mean": list(IMAGE_CONFIG.image_mean),
                   "image_std": list(IMAGE_CONFIG.image_std),
                   "size": {"shortest_edge": IMAGE_CONFIG.min_pixels, "longest_edge": IMAGE_CONFIG.max_pixels}}, f)


def random_image(gen: torch.Generator, width: int, height: int) -> Image.Image:
    data = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
    return Image.frombytes("RGB", (width, height), bytes(data.flatten().tolist()))


def text_ids(rng, n: int) -> list[int]:
    """``n`` random text tokens (below the vision tokens' ids)."""
    return [rng.randrange(1, VISION_START) for _ in range(n)]


def with_images(rng, processed: list) -> list[int]:
    """Text, then per image: <vision_start>, its placeholders expanded, <vision_end>, text."""
    ids = text_ids(rng, rng.randint(3, 9))
    for image in processed:
        ids += [VISION_START] + [IMAGE_TOKEN] * image.num_tokens(IMAGE_CONFIG.merge_size) + [VISION_END]
        ids += text_ids(rng, rng.randint(2, 7))
    return ids


def hf_greedy_pixels(model, prompt: list[int], pixels: dict, max_new: int) -> list[int]:
    """transformers' ``max_new`` greedy tokens after ``prompt``, its image placeholders standing for ``pixels``
    (``pixel_values`` and ``image_grid_thw``; none for a text-only prompt)."""
    ids = torch.tensor([prompt])
    kwargs = dict(pixels, mm_token_type_ids=(ids == IMAGE_TOKEN).int()) if pixels else {}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             min_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


def hf_greedy(model, prompt: list[int], processed: list, max_new: int) -> list[int]:
    """``hf_greedy_pixels`` over images as the engine preprocesses them (``process_image``'s results)."""
    pixels = {}
    if processed:
        pixels = dict(pixel_values=torch.cat([p.pixel_values for p in processed]),
                      image_grid_thw=torch.tensor([p.grid_thw for p in processed]))
    return hf_greedy_pixels(model, prompt, pixels, max_new)


def loaded_tower(model) -> Qwen3VisionTower:
    """The engine's tower with ``model``'s own weights (``model.visual.``)."""
    tower = Qwen3VisionTower(VisionConfig.from_hf(model.config.vision_config))
    prefix = "model.visual."
    tower.load_state_dict({k[len(prefix):]: v for k, v in model.state_dict().items() if k.startswith(prefix)})
    return tower


def tower_against_transformers(model, images: list) -> tuple[list, object]:
    """The engine's tower loaded from ``model``'s own weights (``model.visual.``), run on each of ``images``
    (``process_image``'s results) alone, its merged features checked against transformers' ``get_image_features``
    on them all at once; returns (our ``VisionFeatures`` per image, transformers' output)."""
    tower = loaded_tower(model)
    with torch.no_grad():
        ref = model.model.get_image_features(torch.cat([p.pixel_values for p in images]),
                                             torch.tensor([p.grid_thw for p in images]))
        ours = [tower(image.pixel_values, image.grid_thw) for image in images]
    for i, features in enumerate(ours):
        torch.testing.assert_close(features.embeds, ref.pooler_output[i], rtol=1e-5, atol=1e-5)
    return ours, ref
