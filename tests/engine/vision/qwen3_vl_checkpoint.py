"""A tiny random Qwen3-VL-MoE checkpoint (transformers' ``Qwen3VLMoeForConditionalGeneration``, every parameter
drawn at random) and random images for it: the reference the vision tests compare against."""

import torch
from PIL import Image
from transformers import AutoConfig, AutoModelForImageTextToText

from engine.vision.qwen_image_processing import QwenImageConfig
from tests.hf_models import randomize_constants_

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
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1,
                         max_position_embeddings=1024, eos_token_id=VOCAB - 1, bos_token_id=None, pad_token_id=0,
                         initializer_range=0.08,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2],
                                              mrope_interleaved=True)),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=32,
                           patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16,
                           deepstack_visual_indexes=[0, 1], initializer_range=0.08),
        image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    randomize_constants_(model, torch.Generator().manual_seed(seed))
    model.save_pretrained(path)
    return model


def random_image(gen: torch.Generator, width: int, height: int) -> Image.Image:
    data = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
    return Image.frombytes("RGB", (width, height), bytes(data.flatten().tolist()))
