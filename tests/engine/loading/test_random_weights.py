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
    "gpt-oss-20b": (20.91, 3.61),  # the model card's table gives two decimals
    "gpt-oss-120b": (116.83, 5.13),
}
# Cards that round to whole billions and count active parameters without the embeddings (nor GLM's MTP layer).
PUBLISHED_ROUNDED = {"glm-4.5-air": (106, 12), "minimax-m2": (230, 10)}
# Model cards whose "active" leaves out the input embedding (a lookup, not a matmul).
ACTIVE_WITHOUT_EMBEDDING = {"gpt-oss-20b", "gpt-oss-120b"}
# A CPU-sized Qwen3-MoE: the preset with its sizes overridden.
TINY_GPT_OSS = "gpt-oss-20b:num_hidden_layers=2,hidden_size=64,intermediate_size=32,num_local_experts=4,num_attention_heads=4,num_key_value_heads=2,head_dim=16,vocab_size=128,sliding_window=4,eos_token_id=127,pad_token_id=0,max_position_embeddings=256"
TINY = "qwen3-30b-a3b:num_hidden_layers=2,hidden_size=64,intermediate_size=96,moe_intermediate_size=32,num_experts=8,num_attention_heads=4,num_key_value_heads=2,head_dim=16,vocab_size=128,bos_token_id=null,eos_token_id=127,max_position_embeddings=256"


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_have_the_published_sizes(name):
    config = random_model_config(name)
    total, active = count_parameters(config)
    if name in ACTIVE_WITHOUT_EMBEDDING:
        active -= config.vocab_size * config.hidden_size
    want_total, want_active = PUBLISHED[name]
    # Model cards round to 0.1B: within half of that, plus a little for the rounding of "active".
    assert abs(total / 1e9 - want_total) <= 0.05, (name, total)
    assert abs(active / 1e9 - want_active) <= 0.06, (name, active)


@pytest.mark.parametrize("name", list(PUBLISHED_ROUNDED))
def test_rounded_presets_have_the_published_sizes(name):
    config = random_model_config(name)
    total, active = count_parameters(config)
    embeddings = 2 * config.vocab_size * config.hidden_size  # input embeddings and LM head, untied
    want_total, want_active = PUBLISHED_ROUNDED[name]
    assert abs(total / 1e9 - want_total) <= 0.01 * want_total, (name, total)
    assert abs((active - embeddings) / 1e9 - want_active) <= 0.5, (name, active)


@pytest.mark.parametrize("name", list(PUBLISHED_ROUNDED))
def test_tiny_versions_of_the_new_presets_generate(name):
    """The preset's family, shrunk: built with random weights (the correction biases drawn too) and served."""
    tiny = {"glm-4.5-air": "n_routed_experts=8,num_experts_per_tok=2,moe_intermediate_size=32,num_attention_heads=4,n_group=2",
            "minimax-m2": "num_local_experts=8,num_attention_heads=4,rotary_dim=8,head_dim=16"}[name]
    spec = (f"{name}:num_hidden_layers=2,hidden_size=64,intermediate_size=64,num_key_value_heads=2,vocab_size=128,"
            f"bos_token_id=null,pad_token_id=null,eos_token_id=127,max_position_embeddings=256,{tiny}")
    # In bfloat16, the router and its correction bias stay float32 (as the checkpoints keep them).
    model = build_random_model(random_model_config(spec), torch.bfloat16, torch.device("cpu"), "torch", 64, seed=3)
    blocks = [m for m in model.modules() if getattr(m, "e_score_correction_bias", None) is not None]
    assert blocks and all(b.e_score_correction_bias.dtype == b.gate.weight.dtype == torch.float32 for b in blocks)
    assert all(b.e_score_correction_bias.std() > 0 and b.experts.w13.dtype == torch.bfloat16 for b in blocks)
    llm = LLM(model="random-tiny", random_weights=spec, dtype="float32", device="cpu", num_kv_blocks=16)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


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


# Heads, KV heads, the expert and dense intermediate sizes divide by 2; the vocabulary (127) does not, so the last
# rank's final row of the embeddings and LM head is padding. Layer 0 of the Qwen1.5 variant is dense (qkv bias, a
# shared expert beside the experts of layer 1).
SPLIT = ("num_hidden_layers=2,hidden_size=64,intermediate_size=64,moe_intermediate_size=32,num_attention_heads=4,"
         "num_key_value_heads=2,head_dim=16,vocab_size=127,max_position_embeddings=256,bos_token_id=null,"
         "eos_token_id=126,num_experts=8")
SPLIT_SPECS = {"qwen3": f"qwen3-30b-a3b:{SPLIT}",
               "qwen1.5": f"qwen1.5-moe-a2.7b:{SPLIT},shared_expert_intermediate_size=64,mlp_only_layers=[0]"}


def _rank_group(rank: int, size: int, experts_rank: int | None = None, experts_size: int = 0):
    """A shape-only group that is rank ``rank`` of ``size`` (and rank ``experts_rank`` of ``experts_size`` ranks
    dividing the experts, if given): what a rank builds, without processes."""
    from engine.distributed.collectives import TensorParallel
    from engine.distributed.expert_parallel import ExpertParallel

    tp = TensorParallel.shape_only(size)
    tp.rank = rank
    if experts_rank is not None:
        everyone = TensorParallel.shape_only(experts_size)
        everyone.rank = experts_rank
        tp.expert_parallel = ExpertParallel(everyone)
    return tp


def _tensor_parallel_slices(whole: dict, rank: int, moe_layer: int) -> dict:
    """Rank ``rank`` of 2's slices of the unsplit weights, cut by hand from the layer definitions (4 heads, 2 KV
    heads of 16, expert intermediate 32, vocabulary 127 padded to 2 x 64 rows)."""
    r = rank
    attn, moe = "model.layers.0.self_attn", f"model.layers.{moe_layer}.mlp"
    qkv = whole[f"{attn}.qkv_proj.weight"]  # [64 q + 32 k + 32 v, 64]
    w13 = whole[f"{moe}.experts.w13"]  # [8, 2 x 32, 64]
    vocab_rows = torch.zeros(64, 64)
    vocab_rows[:min(64, 127 - 64 * r)] = whole["lm_head.weight"][64 * r:64 * (r + 1)]
    return {
        f"{attn}.qkv_proj.weight": torch.cat([qkv[32 * r:32 * (r + 1)], qkv[64 + 16 * r:64 + 16 * (r + 1)],
                                              qkv[96 + 16 * r:96 + 16 * (r + 1)]]),
        f"{attn}.o_proj.weight": whole[f"{attn}.o_proj.weight"][:, 32 * r:32 * (r + 1)],
        f"{moe}.experts.w13": torch.cat([w13[:, 16 * r:16 * (r + 1)], w13[:, 32 + 16 * r:32 + 16 * (r + 1)]], dim=1),
        f"{moe}.experts.w2": whole[f"{moe}.experts.w2"][:, :, 16 * r:16 * (r + 1)],
        f"{moe}.gate.weight": whole[f"{moe}.gate.weight"],  # the router: whole on every rank
        "lm_head.weight": vocab_rows,
        "model.norm.weight": whole["model.norm.weight"],
    }


@pytest.mark.parametrize("family", sorted(SPLIT_SPECS))
def test_a_ranks_random_weights_are_the_slices_of_the_unsplit_weights(family):
    """Tensor parallel, experts divided (2 ranks; 2 replicas x 2 ranks): every slice a rank holds is the
    unsplit model's, for a fresh seed."""
    import random

    seed = random.randrange(2**31)
    config = random_model_config(SPLIT_SPECS[family])
    moe_layer = 1 if family == "qwen1.5" else 0

    def build(tp=None):
        kwargs = {} if tp is None else {"tp": tp}
        model = build_random_model(config, torch.float32, torch.device("cpu"), "torch", 64, seed, **kwargs)
        return {name: p.detach() for name, p in model.named_parameters()}

    whole = build()
    assert whole["lm_head.weight"].shape == (127, 64) and 0.015 < whole["lm_head.weight"].std() < 0.025
    for rank in (0, 1):
        held = build(_rank_group(rank, 2))
        for name, want in _tensor_parallel_slices(whole, rank, moe_layer).items():
            assert torch.equal(held[name], want), f"{name} rank {rank} seed={seed}"
        if family == "qwen1.5":  # the shared expert: split like a dense MLP, gate rows then up rows
            gate_up = whole["model.layers.1.mlp.shared_expert.gate_up_proj.weight"]  # [2 x 64, 64]
            want = torch.cat([gate_up[32 * rank:32 * (rank + 1)], gate_up[64 + 32 * rank:64 + 32 * (rank + 1)]])
            assert torch.equal(held["model.layers.1.mlp.shared_expert.gate_up_proj.weight"], want), seed
        # The experts divided among the 2 ranks of one replica, then among 4 ranks of two replicas of 2.
        for experts_rank, experts_size, first, count in ((rank, 2, 4 * rank, 4), (2 + rank, 4, 2 * (2 + rank), 2)):
            held = build(_rank_group(rank, 2, experts_rank, experts_size))
            for name in ("w13", "w2"):
                key = f"model.layers.{moe_layer}.mlp.experts.{name}"
                assert torch.equal(held[key], whole[key][first:first + count]), f"{key} {experts_rank} seed={seed}"
            assert torch.equal(held["model.layers.0.self_attn.o_proj.weight"],
                               whole["model.layers.0.self_attn.o_proj.weight"][:, 32 * rank:32 * (rank + 1)])


def test_split_8bit_random_experts_are_quantized_from_the_ranks_slices():
    """8-bit experts: divided whole among ranks they are the unsplit 8-bit experts; under tensor parallelism each
    rank quantizes its slice of the unsplit float experts, as a checkpoint's are (per output channel: the gate/up
    rows keep their scales, the down projection's channels are rescaled over the rank's half)."""
    from engine.loading.quantization import scheme_for_option
    from moe_kernels.quant import quantize

    config = random_model_config(SPLIT_SPECS["qwen3"])
    scheme = scheme_for_option("int8")

    def experts(tp=None, quantization=None):
        kwargs = {} if tp is None else {"tp": tp}
        model = build_random_model(config, torch.float32, torch.device("cpu"), "torch", 64, 7, quantization, **kwargs)
        return model.model.layers[1].mlp.experts

    floats, whole = experts(), experts(quantization=scheme)
    for rank in (0, 1):
        divided = experts(_rank_group(rank, 2, rank, 2), scheme)
        for name in ("w13", "w13_scale", "w2", "w2_scale"):
            assert torch.equal(getattr(divided, name), getattr(whole, name)[4 * rank:4 * (rank + 1)]), name
        split = experts(_rank_group(rank, 2), scheme)
        rows = torch.cat([torch.arange(16 * rank, 16 * (rank + 1)), torch.arange(32 + 16 * rank, 32 + 16 * (rank + 1))])
        assert torch.equal(split.w13, whole.w13[:, rows]) and torch.equal(split.w13_scale, whole.w13_scale[:, rows])
        q, scale = quantize(floats.w2.detach()[:, :, 16 * rank:16 * (rank + 1)], scheme)  # [8, 64, 16]
        assert torch.equal(split.w2, q) and torch.equal(split.w2_scale, scale)


def test_a_parameter_the_tensor_list_misses_is_refused_not_left_unfilled(monkeypatch):
    """A family whose weights the random fill does not list would otherwise serve ``to_empty``'s garbage."""
    import random

    from engine.loading import random_weights

    listed = random_weights._checkpoint_tensors
    names = [name for name, _ in listed(build_random_model(random_model_config(TINY), torch.float32,
                                                           torch.device("meta"), "torch", 64))]
    dropped = random.choice(names)
    monkeypatch.setattr(random_weights, "_checkpoint_tensors",
                        lambda whole: ((n, s) for n, s in listed(whole) if n != dropped))
    with pytest.raises(RuntimeError, match="unfilled"):
        build_random_model(random_model_config(TINY), torch.float32, torch.device("cpu"), "torch", 64)


def test_gpt_oss_random_model_serves():
    """The gpt-oss preset, made tiny: its first layer is windowed, and its tokens do not depend on the batch."""
    config = random_model_config(TINY_GPT_OSS)
    assert config.sliding_layers == (0,) and config.layer_sliding_window == 4 and config.sliding_window is None
    llm = LLM(model="random-gpt-oss", random_weights=TINY_GPT_OSS, dtype="float32", device="cpu", num_kv_blocks=32)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    together = [o.token_ids for o in llm.generate([[1, 2, 3] * 5, [7] * 9], params)]
    alone = [llm.generate([p], params)[0].token_ids for p in ([1, 2, 3] * 5, [7] * 9)]
    assert together == alone and all(len(t) == 5 for t in together)


@pytest.mark.parametrize("family", ["mimo_v2_flash", "hy_v3"])
def test_random_weights_from_a_config_json_whose_layers_differ(family, tmp_path):
    """A config.json path of a family whose layers differ in KV heads and whose v heads are narrower (MiMo-V2-Flash),
    or that renames its tensors (Hy3): every layer's q/k/v drawn at its own widths, and the engine generates."""
    from tests.hf_models import make_hf_model

    make_hf_model(family, str(tmp_path), seed=0)
    spec = str(tmp_path / "config.json")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    runs = [[o.token_ids for o in LLM(model="random", random_weights=spec, dtype="float32", device="cpu",
                                      num_kv_blocks=32, seed=1).generate([[1, 2, 3], [5] * 20], params)]
            for _ in range(2)]
    assert runs[0] == runs[1] and all(len(t) == 4 for t in runs[0])
