"""Checkpoint loading: sharded files, and one-line errors that name the file."""

import json
import os
import random

import pytest
import torch

from engine import LLM, CheckpointError, SamplingParams
from tests.hf_models import make_hf_model

# What is loaded, not the KV pool, is under test: 16 blocks of 16 hold the longest request here (64 tokens), where
# the pool sized from memory (2 GB) takes ~1.5 s to build per engine on the CPU.
SMALL_POOL = 16


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3"))
    make_hf_model("qwen3_moe", path, seed=random.randrange(2**31))
    return path


def test_sharded_checkpoint_loads_same_weights(tmp_path):
    seed = random.randrange(2**31)
    hf = make_hf_model("mixtral", str(tmp_path / "one"), seed=seed)
    hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="40KB")
    files = os.listdir(tmp_path / "sharded")
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 2
    prompt = [random.randrange(1, 200) for _ in range(17)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a = LLM(model=str(tmp_path / "one"), num_kv_blocks=SMALL_POOL).generate([prompt], params)[0]
    b = LLM(model=str(tmp_path / "sharded"), num_kv_blocks=SMALL_POOL).generate([prompt], params)[0]
    assert a.token_ids == b.token_ids
    assert a.text == "" and b.text == ""  # no tokenizer files: token ids still served


def _one_line(err: Exception) -> str:
    msg = str(err)
    assert "\n" not in msg
    return msg


def test_unsupported_architecture(tmp_path, qwen3_dir):
    cfg = json.load(open(os.path.join(qwen3_dir, "config.json")))
    cfg["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        LLM(model=str(tmp_path))
    assert "config.json" in _one_line(e.value) and "LlamaForCausalLM" in str(e.value)


def test_missing_dir_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        LLM(model=str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="config.json: file not found"):
        LLM(model=str(tmp_path))


def _copy_config(src: str, dst) -> None:
    for name in ("config.json", "generation_config.json"):
        (dst / name).write_text(open(os.path.join(src, name)).read())


def test_missing_and_corrupt_weights(tmp_path, qwen3_dir):
    _copy_config(qwen3_dir, tmp_path)
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        LLM(model=str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(CheckpointError) as e:
        LLM(model=str(tmp_path))
    assert "model.safetensors" in _one_line(e.value)


def test_missing_tensor_is_named(tmp_path, qwen3_dir):
    from safetensors.torch import load_file, save_file

    _copy_config(qwen3_dir, tmp_path)
    tensors = load_file(os.path.join(qwen3_dir, "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.3.down_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="layers.1.mlp.experts.w2"):
        LLM(model=str(tmp_path))


def test_misshapen_tensor_is_named(tmp_path, qwen3_dir):
    from safetensors.torch import load_file, save_file

    _copy_config(qwen3_dir, tmp_path)
    tensors = load_file(os.path.join(qwen3_dir, "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.norm.weight has shape"):
        LLM(model=str(tmp_path))


def test_bad_requests_queue_nothing(qwen3_dir):
    llm = LLM(model=qwen3_dir, max_model_len=64, num_kv_blocks=SMALL_POOL)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, 2], [5, 10_000]], SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="at most 63 prompt tokens"):
        llm.generate([[1] * 10, [1] * 64], SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["hello"], SamplingParams(max_tokens=3))
    assert not llm.engine.has_unfinished()
    llm.engine.scheduler.kv.pool.check_all_free()
    # Generation stops at max_model_len even if max_tokens asks for more.
    out = llm.generate([[3] * 60], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_next_token_prediction_layer_is_skipped_with_one_log_line(tmp_path, caplog):
    """A GLM-4.5 checkpoint with its MTP layer (model.layers.<num_hidden_layers>.*, as published): the layer's
    tensors are skipped (one log line for all of them) and the model generates transformers' tokens."""
    from safetensors.torch import load_file, save_file

    from tests.engine.models.test_vs_transformers import hf_greedy

    seed = random.randrange(2**31)
    hf = make_hf_model("glm4_moe", str(tmp_path), seed=seed)
    path = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(path)
    layer = hf.config.num_hidden_layers
    gen = torch.Generator().manual_seed(seed)
    mtp = {f"model.layers.{layer}.{name}": torch.randn(shape, generator=gen) for name, shape in (
        ("eh_proj.weight", (64, 128)), ("enorm.weight", (64,)), ("shared_head.norm.weight", (64,)),
        ("mlp.experts.0.gate_proj.weight", (24, 64)), ("mlp.gate.e_score_correction_bias", (8,)))}
    save_file({**tensors, **mtp}, path, metadata={"format": "pt"})
    prompt = [random.Random(seed).randrange(1, 200) for _ in range(11)]
    with caplog.at_level("INFO", logger="engine.loading.model_loader"):
        llm = LLM(model=str(tmp_path), num_kv_blocks=SMALL_POOL, dtype="float32")
    notes = [r.getMessage() for r in caplog.records if "next-token-prediction" in r.getMessage()]
    assert len(notes) == 1 and f"skipped {len(mtp)} tensors" in notes[0], notes
    assert not [r for r in caplog.records if "ignoring tensor" in r.getMessage()]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf, prompt, 6), f"seed={seed}"
