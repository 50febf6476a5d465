"""DeepSeek-V3 checkpoints as published: FP8 with 128x128-style block scales (``weight_scale_inv``), next-token-
prediction layers past ``num_hidden_layers`` (skipped, said once in the log), and Kimi-K2's ``model_type``
(``kimi_k2``, a config class transformers only has as remote code) read as the DeepSeek-V3 config."""

import json
import logging
import os
import random

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from tests.engine.loading.test_quantized_experts import write_variants
from tests.engine.models.test_vs_transformers import hf_greedy
from tests.hf_models import make_hf_model

VOCAB = 211
# The attention and dense/shared MLP projections stored FP8 (the routed experts are covered by
# tests/engine/loading/test_quantized_experts.py), in blocks that do not divide every shape.
FP8_NAMES = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_fp8_block_kimi_checkpoint_with_mtp_layers(tmp_path, caplog):
    seed = random.randrange(2**31)
    src, fp8_dir, ref_dir = (str(tmp_path / d) for d in ("src", "fp8", "ref"))
    make_hf_model("deepseek_v3", src, seed=seed, vocab_size=VOCAB, num_layers=2)
    quantized = write_variants(src, fp8_dir, ref_dir, "fp8", (16, 32), FP8_NAMES)
    assert any("kv_b_proj" in name for name in quantized) and any("shared_experts" in name for name in quantized)
    # The next-token-prediction layer (index num_hidden_layers) as DeepSeek-V3 ships it; Kimi-K2's model_type.
    tensors = load_file(os.path.join(fp8_dir, "model.safetensors"))
    hidden = tensors["model.norm.weight"].shape[0]
    tensors["model.layers.2.eh_proj.weight"] = torch.randn(hidden, 2 * hidden)
    tensors["model.layers.2.self_attn.kv_b_proj.weight"] = tensors["model.layers.1.self_attn.kv_b_proj.weight"].clone()
    save_file(tensors, os.path.join(fp8_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(fp8_dir, "config.json")) as f:
        config = json.load(f)
    config.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})
    with open(os.path.join(fp8_dir, "config.json"), "w") as f:
        json.dump(config, f)

    rng = random.Random(seed)
    reqs = [([rng.randrange(1, VOCAB - 1) for _ in range(rng.randint(5, 60))], 10) for _ in range(4)]
    reference = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()  # the dequantized weights
    expected = [hf_greedy(reference, p, m) for p, m in reqs]
    with caplog.at_level(logging.INFO, logger="engine.loading.model_loader"):
        llm = LLM(model=fp8_dir, dtype="float32", device="cpu", num_kv_blocks=64)
    assert llm.engine.model_config.architecture == "DeepseekV3ForCausalLM"
    skipped = [r.message for r in caplog.records if "tensors of layers past num_hidden_layers" in r.message]
    assert len(skipped) == 1 and "skipped 2 tensors" in skipped[0], caplog.text
    assert "ignoring tensor" not in caplog.text
    outs = llm.generate([p for p, _ in reqs], [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs])
    assert [o.token_ids for o in outs] == expected, f"seed={seed}"
