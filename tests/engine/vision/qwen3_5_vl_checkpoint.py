"""A tiny random Qwen3.5-MoE image-text checkpoint (transformers' ``Qwen3_5MoeForConditionalGeneration``, every
parameter drawn at random) with its tokenizer and chat template: the reference the Qwen3.5 image tests compare
against. Its token ids and image settings are the Qwen3-VL checkpoint's (``qwen3_vl_checkpoint``), so the same
tokenizer, processor and images serve both. ``tests/conftest.py``'s session fixture ``qwen3_5_vl_checkpoint``
builds one for every test file that reads it."""

from tests.engine.vision.qwen3_vl_checkpoint import (IMAGE_TOKEN, VIDEO_TOKEN, VISION_END, VISION_START, VOCAB,
                                                     write_preprocessor_config)
from tests.hf_models import make_hf_image_text_model


def make_qwen3_5_moe_vl(path: str, seed: int, **text):
    """The hybrid text model of ``tests.hf_models`` (a Gated DeltaNet layer, then a gated full-attention one; width
    48, heads of 24) under interleaved M-RoPE over half of each head (12 dims: sections 2, 2, 2), and a vision
    tower of depth 2, width 32, 4-pixel patches merged 2x2 (no deepstack taps: Qwen3.5 has none). Saved to
    ``path`` with ``preprocessor_config.json`` and the tokenizer (``text``: more text-config settings); returns (transformers' model (eval, float32),
    the tokenizer)."""
    from tests.gateway.test_chat_images import write_tokenizer

    rope = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[2, 2, 2],
                mrope_interleaved=True)
    model = make_hf_image_text_model(
        "qwen3_5_moe", path, seed, vocab_size=VOCAB, text=dict(rope_parameters=rope, **text),
        vision=dict(depth=2, hidden_size=32, intermediate_size=48, temporal_patch_size=2, spatial_merge_size=2,
                    initializer_range=0.08),
        image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, tie_word_embeddings=False)
    write_preprocessor_config(path)
    return model, write_tokenizer(path)
