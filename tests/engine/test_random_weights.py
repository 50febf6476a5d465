"""Random-weight models from real configs: preset shapes, spec parsing, building on the target device."""

import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.loading.random_weights import PRESETS, build_random_model, count_parameters, parse_spec, random_model_config

# Published sizes (model cards), in billions: (total, active per token).
PUBLISHED = {
    "qwen3-30b-a3b": (30.5, 3.3),
    "olmoe-1b-7b": (6.9, 1.3),
    "qwen1.5-moe-a2.7b": (14.3, 2.7),
    "mixtral-8x7b": (46.7, 12.9),
}
# A CPU-sized Qwen3-MoE: the preset with its sizes overridden.
TINY = "qwen3-30b-a3b:num_hidden_layers=2,hidden_size=64,intermediate_size=96,moe_intermediate_size=32,num_experts=8,num_attention_heads=4,num_key_value_heads=2,head_dim=16,vocab_size=128,bos_token_id=null,eos_token_id=127,max_position_embeddings=256"


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_have_the_published_sizes(name):
    total, active = count_parameters(random_model_config(name))
    want_total, want_active = PUBLISHED[name]
    # Model cards round to 0.1B: within half of that, plus a little for the rounding of "active".
    assert abs(total / 1e9 - want_total) <= 0.05, (name, total)
    assert abs(active / 1e9 - want_active) <= 0.06, (name, active)


def test_spec_overrides_and_errors():
    base, overrides = parse_spec("olmoe-1b-7b:num_hidden_layers=2,norm_topk_prob=true,rope_scaling=null")
    assert base == "olmoe-1b-7b" and overrides == {"num_hidden_layers": 2, "norm_topk_prob": True, "rope_scaling": None}
    config = random_model_config("mixtral-8x7b:num_hidden_layers=3,hidden_size=256")
    assert (config.num_layers, config.hidden_size, config.num_kv_heads) == (3, 256, 8)
    for bad in ("no-such-model", "qwen3-30b-a3b:num_hidden_layers", ":a=1"):
        with pytest.raises(ValueError):
            random_model_config(bad)


def test_config_json_path_equals_preset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["qwen1.5-moe-a2.7b"]))
    from_path = random_model_config(f"{tmp_path}:num_hidden_layers=2")
    from_preset = random_model_config("qwen1.5-moe-a2.7b:num_hidden_layers=2")
    assert from_path.architecture == from_preset.architecture == "Qwen2MoeForCausalLM"
    assert count_parameters(from_path) == count_parameters(from_preset)


def test_built_in_target_dtype_on_device_without_float32_copies():
    config = random_model_config(TINY)
    model = build_random_model(config, torch.bfloat16, torch.device("cpu"), "torch", max_positions=64, seed=3)
    params = dict(model.named_parameters())
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in params.values())
    w13 = params["model.layers.0.mlp.experts.w13"]
    assert w13.shape == (8, 64, 64)
    assert 0.015 < w13.float().std().item() < 0.025  # normal(0, 0.02)
    assert torch.all(params["model.norm.weight"] == 1)
    again = build_random_model(config, torch.bfloat16, torch.device("cpu"), "torch", max_positions=64, seed=3)
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)  # the seed fixes the weights
    other = build_random_model(config, torch.bfloat16, torch.device("cpu"), "torch", max_positions=64, seed=4)
    assert not torch.equal(other.lm_head.weight, model.lm_head.weight)


def test_engine_serves_a_random_weight_model():
    llm = LLM(model="random-tiny", random_weights=TINY, dtype="float32", device="cpu", num_kv_blocks=32, seed=1)
    assert llm.tokenizer is None  # token-id prompts only
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = [o.token_ids for o in llm.generate([[1, 2, 3], [5] * 20], params)]
    again = LLM(model="random-tiny", random_weights=TINY, dtype="float32", device="cpu", num_kv_blocks=32, seed=1)
    assert [o.token_ids for o in again.generate([[1, 2, 3], [5] * 20], params)] == first
    assert all(len(t) == 4 and all(0 <= x < 128 for x in t) for t in first)
    stats = again.engine.stats()  # host time of the last step, split by part
    assert 0 < stats.step_prepare_ms <= stats.step_execute_ms and stats.step_schedule_ms > 0


def test_command_lines_take_random_weights(tmp_path, capsys):
    from gateway.cli import main

    # serve: a bad spec is bad input (one line, exit 2) before anything starts.
    assert main(["serve", "--model", str(tmp_path), "--random-weights", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no-such-model" in err
    # loadgen offline: moegate alone on the random model (the workload's token ids need a vocab of 8192).
    spec = TINY.replace("vocab_size=128", "vocab_size=8192").replace("=256", "=1024")
    # Seed 149 draws one short request (52 prompt tokens, 8 output tokens): a fast run.
    assert main(["loadgen", "offline", "--random-weights", spec, "--num-requests", "1", "--seed", "149", "--json"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{\n"):])
    assert [r["system"] for r in report["results"]] == ["moegate"] and report["results"][0]["output_tokens"] > 0
