"""Kimi-K2's INT4 checkpoints (compressed-tensors pack-quantized routed experts, as Kimi-K2-Thinking, K2.5 and K2.6
publish them) end to end on the CPU: a tiny random DeepSeek-V3-layout model whose experts compressed-tensors' own
compressor quantized (``int4_checkpoint``), served by the engine under Kimi-K2's ``model_type``, against
transformers loading the same checkpoint through its compressed-tensors integration.

The engine keeps the experts packed as stored (int32 words, bfloat16 scales) and must produce transformers' greedy
tokens exactly: both decode each weight to the same bfloat16 value (compressed-tensors' rounding), run in float32.
What is not served is refused naming the field or the tensor: other quantization_configs and settings at start,
unexpected tensors (float32 scales, a packed layer outside the routed experts) while loading.
"""

import json
import os
import random

import pytest
import torch

if not torch.cuda.is_available():  # before moe_kernels.triton_backend is first imported (see its docstring)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from engine import LLM, KernelChoice, SamplingParams  # noqa: E402
from engine.core.config import EngineConfig  # noqa: E402
from engine.core.model_config import CheckpointError  # noqa: E402
from engine.loading.model_check import check_model  # noqa: E402
from moe_kernels.int4 import dequantize_int4  # noqa: E402
from tests.engine.loading.int4_checkpoint import compress, decompressed, float_experts_, write_int4  # noqa: E402
from tests.engine.models.test_vs_transformers import hf_greedy  # noqa: E402
from tests.hf_models import make_hf_model  # noqa: E402

VOCAB = 211
SHAPE = dict(moe_intermediate_size=64)  # two scale groups along the down projection's K (H = 64: two along w13's)
KIMI_K2 = dict(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(seed, transformers' copy (model_type deepseek_v3), the engine's copy (kimi_k2), the stored tensors)."""
    seed = random.randrange(2**31)
    root = tmp_path_factory.mktemp("int4")
    src, hf_dir, kimi_dir = (str(root / d) for d in ("src", "hf", "kimi"))
    make_hf_model("deepseek_v3", src, seed=seed, vocab_size=VOCAB, num_layers=2, **SHAPE)
    stored = write_int4(src, hf_dir)
    write_int4(src, kimi_dir, KIMI_K2)
    return seed, hf_dir, kimi_dir, stored


@pytest.mark.parametrize("moe", ["torch", "triton"])
def test_int4_kimi_checkpoint_vs_transformers(checkpoints, moe):
    seed, hf_dir, kimi_dir, stored = checkpoints
    rng = random.Random(seed)
    # (the Triton kernels run interpreted on the CPU: fewer tokens)
    reqs = [([rng.randrange(1, VOCAB - 1) for _ in range(rng.randint(5, 40))], 8 if moe == "torch" else 5)
            for _ in range(3 if moe == "torch" else 2)]
    device = "cuda" if moe == "triton" and torch.cuda.is_available() else "cpu"  # else Triton's interpreter
    llm = LLM(model=kimi_dir, dtype="float32", device=device, num_kv_blocks=64, kernel_choice=KernelChoice(moe=moe))
    assert llm.engine.model_config.architecture == "DeepseekV3ForCausalLM"
    experts = llm.engine.model.model.layers[1].mlp.experts
    # Packed as stored: the checkpoint's words and scales, gate rows then up rows.
    stem = "model.layers.1.mlp.experts.5"
    assert experts.scheme.method == "int4" and experts.w13.dtype == torch.int32
    assert torch.equal(experts.w13[5].cpu(), torch.cat([stored[f"{stem}.gate_proj.weight_packed"],
                                                  stored[f"{stem}.up_proj.weight_packed"]]))
    assert torch.equal(experts.w2_scale[5].cpu(), stored[f"{stem}.down_proj.weight_scale"])
    outs = llm.generate([p for p, _ in reqs], [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                                              for _, m in reqs])
    got = [o.token_ids for o in outs]

    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    hf_experts = reference.model.layers[1].mlp.experts
    # transformers decompressed through compressed-tensors: the same bfloat16 values the engine decodes.
    assert torch.equal(hf_experts.down_proj[5], decompressed(stored, f"{stem}.down_proj"))
    assert torch.equal(hf_experts.gate_up_proj[5], dequantize_int4(experts.w13[5].cpu(), experts.w13_scale[5].cpu(),
                                                                      torch.bfloat16))
    float_experts_(reference)
    assert got == [hf_greedy(reference, p, m) for p, m in reqs], f"seed={seed}"


def _link_all_but(hf_dir: str, tmp_path, rewritten: str) -> str:
    """``tmp_path`` holding links to every file of ``hf_dir`` but ``rewritten`` (which the caller writes)."""
    for name in os.listdir(hf_dir):
        if name != rewritten:
            os.symlink(os.path.join(hf_dir, name), tmp_path / name)
    return str(tmp_path)


def _variant(hf_dir: str, tmp_path, edit) -> str:
    """A copy of the checkpoint's config.json (weights linked) with ``edit(quantization_config)`` applied."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    edit(config["quantization_config"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    return _link_all_but(hf_dir, tmp_path, "config.json")


REFUSED = {  # what a config says -> the field the one-line refusal names
    "asymmetric": (lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric=False), "weights.symmetric"),
    "group_size_128": (lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=128), "weights.group_size"),
    "num_bits_8": (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=8), "weights.num_bits"),
    "activations": (lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8}),
                    "input_activations"),
    "float_format": (lambda q: q.update(format="float-quantized"), "quantization_config.format"),
    "sparse": (lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity_config"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_unsupported_int4_configs_are_refused_naming_the_field(checkpoints, tmp_path, case):
    edit, field = REFUSED[case]
    path = _variant(checkpoints[1], tmp_path, edit)
    with pytest.raises(ValueError, match=field):
        check_model(EngineConfig(model=path))


def test_int4_settings_refused_before_start(checkpoints):
    """--quantization on an INT4 checkpoint, a tensor-parallel split that cuts scale groups: refused up front by
    ``check_model``, whose ValueErrors the command line prints as one line with exit code 2 (tests/gateway/test_cli.py)."""
    hf_dir = checkpoints[1]
    with pytest.raises(ValueError, match="quantization 'fp8'"):
        check_model(EngineConfig(model=hf_dir, quantization="fp8"))
    with pytest.raises(ValueError, match="tensor_parallel_size 4"):  # 64 / 4 = 16 channels a rank: half a group
        check_model(EngineConfig(model=hf_dir, tensor_parallel_size=4))
    check_model(EngineConfig(model=hf_dir, tensor_parallel_size=2, enable_expert_parallel=True))  # whole experts


def _rewritten(hf_dir: str, tmp_path, edit) -> str:
    """A copy of the checkpoint with ``edit(tensors)`` applied to its tensors."""

    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    return _link_all_but(hf_dir, tmp_path, "model.safetensors")


def _float32_scale(tensors):
    name = "model.layers.1.mlp.experts.2.up_proj.weight_scale"
    tensors[name] = tensors[name].float()


def _packed_attention(tensors):
    w = tensors.pop("model.layers.0.self_attn.o_proj.weight")
    tensors.update({f"model.layers.0.self_attn.o_proj.{k}": v for k, v in compress(w).items()})


@pytest.mark.parametrize("edit,named", [(_float32_scale, "experts.2.up_proj.weight_scale is F32"),
                                        (_packed_attention, "o_proj.weight_packed is INT4")],
                         ids=["float32_scale", "packed_attention"])
def test_unserved_int4_tensors_are_refused_naming_them(checkpoints, tmp_path, edit, named):
    with pytest.raises(CheckpointError, match=named):
        LLM(model=_rewritten(checkpoints[1], tmp_path, edit), dtype="float32", device="cpu", num_kv_blocks=8)
