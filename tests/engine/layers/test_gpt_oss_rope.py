"""gpt-oss's YaRN rope: our cos/sin tables against transformers' GptOssRotaryEmbedding, with and without
``truncate``, past the original context (where YaRN's blend of frequencies and its attention factor show)."""

import pytest
import torch
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

from engine.layers.rotary import RotaryEmbedding
from engine.core.model_config import model_config_from_hf


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_tables_match_transformers(truncate):
    hf = GptOssConfig(
        vocab_size=97, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=2, max_position_embeddings=1024,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                             truncate=truncate, original_max_position_embeddings=64),
    )
    ours = RotaryEmbedding(model_config_from_hf("GptOssForCausalLM", hf, []), 16, 300)
    positions = torch.arange(300)
    cos, sin = GptOssRotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), positions[None])  # [1, P, d/2]
    # Ours holds each frequency twice (NeoX halves); transformers' gpt-oss applies its d/2 to both halves.
    torch.testing.assert_close(ours.cos_cache[:, :8], cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.sin_cache[:, 8:], sin[0], rtol=1e-6, atol=1e-6)
    assert ours.cos_cache[0, 0] > 1.0  # YaRN's attention factor scales the tables (1 + 0.1 ln 32)
    # The slowest frequency is interpolated (divided by the factor): its angle at the last position is not plain rope's.
    angle = torch.atan2(ours.sin_cache[-1, 7], ours.cos_cache[-1, 7]).item()
    plain = 299 / 150000.0 ** (14 / 16)
    assert abs(angle - plain / 32) < 0.05 * plain / 32, (angle, plain)
