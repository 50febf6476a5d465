"""What MiMo-V2-Flash and Hy3 checkpoints cannot be served with is refused at start, in one line naming the flag
or the config field, before any request is taken."""

import random

import pytest

from engine import LLM
from engine.core.model_config import CheckpointError
from tests.hf_models import make_hf_model


def _one_line(error: BaseException) -> str:
    text = str(error)
    assert "\n" not in text, text
    return text


def test_lora_is_refused_for_value_heads_narrower_than_query_heads(tmp_path):
    make_hf_model("mimo_v2_flash", str(tmp_path), seed=random.randrange(2**31))
    with pytest.raises(ValueError) as caught:
        LLM(model=str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=16, enable_lora=True)
    assert "--enable-lora" in _one_line(caught.value) and "v_head_dim" in str(caught.value)


def test_hy_v3_mlp_biases_are_refused(tmp_path):
    make_hf_model("hy_v3", str(tmp_path), seed=random.randrange(2**31), mlp_bias=True)
    with pytest.raises(CheckpointError) as caught:
        LLM(model=str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=16)
    assert "mlp_bias=true is not supported" in _one_line(caught.value)  # (the test folder names mlp_bias too)
