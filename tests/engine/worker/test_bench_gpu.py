"""The GPU benchmark script: its CPU smoke run end to end, its refusal without CUDA, its floor arithmetic."""

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks import engine_gpu as bench_gpu  # noqa: E402
from engine.loading.random_weights import build_random_model, count_parameters, random_model_config  # noqa: E402
from benchmarks.roofline import model_costs, step_floor  # noqa: E402


def test_exits_2_with_one_line_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_gpu.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA device" in err


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "qwen1.5-moe-a2.7b"])
def test_costs_add_up_to_the_active_parameters(preset):
    config = random_model_config(preset + ":num_hidden_layers=2")
    model = build_random_model(config, torch.bfloat16, torch.device("meta"), "torch", max_positions=1)
    costs = model_costs(model)
    total, active = count_parameters(config)
    embed = config.vocab_size * config.hidden_size
    # Active per token = dense + k experts per layer + embedding + LM head (untied in both presets).
    assert costs.dense_params + costs.routed_params_per_token + 2 * embed == active
    assert costs.lm_head_bytes == 2 * embed and costs.embed_row_bytes == 2 * config.hidden_size
    per_layer_kv = 2 * config.num_kv_heads * config.head_dim * 2
    assert costs.kv_bytes_per_token == 2 * per_layer_kv
    floor = step_floor(costs, num_tokens=1, num_logits=1, experts_hit=2 * config.hf_config.num_experts_per_tok,
                       kv_tokens_read=100, attn_pairs=100, bandwidth_bytes_s=1e12, peak_flops_s=1e15)
    # One decode token reads every active weight once (minus the embedding table but one row) and 101 tokens of KV.
    assert floor.bytes == 2 * (active - embed) + 2 * config.hidden_size + 101 * costs.kv_bytes_per_token
    assert floor.bound == "memory" and floor.seconds == pytest.approx(floor.bytes / 1e12)


def test_smoke_run_reports_every_row(tmp_path, capsys):
    path = tmp_path / "report.json"
    assert bench_gpu.main(["--smoke", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    profile = bench_gpu.SMOKE
    assert [r["concurrency"] for r in report["decode"]] == list(profile.concurrency)
    assert [r["tokens"] for r in report["prefill"]] == list(profile.prefill_lens)
    top_k = random_model_config(profile.spec).hf_config.num_experts_per_tok
    for row in report["decode"] + report["prefill"]:
        assert row["tokens_per_s"] > 0 and row["floor_ms"] > 0 and row["time_over_floor"] > 0
    # One decode token is routed to exactly k distinct experts in each layer.
    assert report["decode"][0]["experts_hit_per_layer"] == top_k
    systems = [r["system"] for r in report["e2e"]]
    assert systems[0] == "moegate" and any("generate (one static batch)" in s for s in systems)
    assert all("error" not in r for r in report["e2e"]), report["e2e"]
    out = capsys.readouterr().out
    assert "goal: decode at batch 1 within 1.5x of its floor" in out and "moegate/this" in out
