"""gpt-oss's MXFP4 expert checkpoints: our dequantization against transformers' own, and a whole model loaded from
MXFP4 experts generating transformers' greedy tokens.

The MXFP4 tensors are made here by an independent packer (nearest e2m1 value under a per-32 power-of-two scale),
from fresh random weights; the seed is in every message.
"""

import json
import os
import random

import pytest
import torch
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from engine import LLM, SamplingParams
from engine.core.model_config import load_model_config
from engine.loading.mxfp4 import dequantize_mxfp4
from engine.loading.quantization import resolve_scheme
from moe_kernels.quant import QuantScheme, dequantize
from tests.devices import DEVICES
from tests.engine.models.test_vs_transformers import hf_greedy
from tests.hf_models import make_hf_model

E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


@pytest.fixture
def seed() -> int:
    return random.SystemRandom().randrange(2**31)


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [.., N, K] (K a multiple of 32) -> blocks uint8 [.., N, K/32, 16], scales uint8 [.., N, K/32]."""
    groups = w.double().reshape(*w.shape[:-1], w.shape[-1] // 32, 32)  # [.., N, G, 32]
    amax = groups.abs().amax(-1).clamp_min(2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0))  # the smallest power of two that brings amax within 6
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    codes = (scaled.abs().unsqueeze(-1) - E2M1_MAGNITUDES).abs().argmin(-1)  # nearest magnitude, [.., G, 32]
    codes = codes + 8 * (scaled < 0)  # the sign bit
    codes = codes.to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # element 2j in the low nibble
    return blocks, (exponent + 127).to(torch.uint8)


def test_dequantize_matches_transformers(seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(3, 10, 96, generator=gen) * torch.exp2(torch.randint(-6, 4, (3, 10, 1), generator=gen))
    w[0, 0, :32] = 0.0  # an all-zero block
    blocks, scales = pack_mxfp4(w)
    ours = dequantize_mxfp4(blocks, scales)  # [3, 10, 96]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # back to [E, N, K]
    assert torch.equal(ours, theirs), f"seed={seed}"
    # The packer is right: each value within half the widest e2m1 step (1) times its block's scale.
    step = torch.exp2(scales.double() - 127).repeat_interleave(32, dim=-1)
    assert ((ours.double() - w.double()).abs() <= step + 1e-12).all(), f"seed={seed}"
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16).float(), ours)  # exact in bfloat16


def write_mxfp4_checkpoint(hf, path: str) -> None:
    """Overwrite ``path``'s weights with hf's, its experts in MXFP4 (hf's experts set to the dequantized values,
    transformers' own dequantization, so it is the reference for exactly what the checkpoint holds)."""
    tensors = {}
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                rows = param.transpose(1, 2).contiguous()  # [E, 2I, H] / [E, H, I]: output channels first
                blocks, scales = pack_mxfp4(rows)
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            else:
                tensors[name] = param.detach().clone().contiguous()
    for stale in os.listdir(path):
        if stale.endswith(".safetensors") or stale.endswith(".index.json"):
            os.remove(os.path.join(path, stale))
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "self_attn"]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize("quantization", [None, "int8", "mxfp4"])
@pytest.mark.parametrize("device", DEVICES)  # on CUDA: the Triton MoE kernel on 4-bit experts, attention sinks
def test_mxfp4_checkpoint_generates_transformers_tokens(seed, quantization, device, tmp_path):
    hf = make_hf_model("gpt_oss", str(tmp_path), seed=seed, vocab_size=97, intermediate_size=32)
    write_mxfp4_checkpoint(hf, str(tmp_path))
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 96) for _ in range(n)] for n in (21, 4)]
    llm = LLM(model=str(tmp_path), dtype="float32", device=device, num_kv_blocks=32, quantization=quantization)
    block = llm.engine.runner.model.model.layers[0].mlp
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    want = hf.model.layers[0].mlp.experts.down_proj.detach().transpose(1, 2)  # [E, H, I]
    if quantization == "mxfp4":  # kept in 4 bits (the torch path dequantizes per call): the same values, tokens
        experts = block.experts
        assert experts.w2.dtype == torch.uint8 and tuple(experts.w2.shape) == (*want.shape[:-1], want.shape[-1] // 2)
        assert torch.equal(dequantize(experts.w2.detach().cpu(), experts.w2_scale.detach().cpu()), want), f"seed={seed}"
        gate_up = hf.model.layers[0].mlp.experts.gate_up_proj.detach().transpose(1, 2)  # [E, 2I, H], interleaved
        w13 = dequantize(experts.w13.detach().cpu(), experts.w13_scale.detach().cpu())  # [E, 2I, H], gate rows then up rows
        assert torch.equal(w13, torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)), f"seed={seed}"
    if quantization in (None, "mxfp4"):
        expected = [hf_greedy(hf, p, 8) for p in prompts]
        assert [o.token_ids for o in outs] == expected, f"seed={seed}"
    if quantization is None:
        assert torch.equal(block.experts.w2.detach().cpu(), want), f"seed={seed}: w2 is the dequantized down_proj"
        # Left unset, the checkpoint's MXFP4 experts are dequantized everywhere (the 4-bit load builds the model in
        # float32 on the host first): 4 bits only when asked for.
        config = load_model_config(str(tmp_path))
        cuda, cpu = torch.device("cuda"), torch.device("cpu")
        assert resolve_scheme(None, config, cuda, "triton") is None and resolve_scheme(None, config, cpu, "torch") is None
        assert resolve_scheme("mxfp4", config, cuda, "triton") == QuantScheme("mxfp4")
    if quantization == "int8":  # 8-bit storage of the dequantized experts: within half an int8 step of them
        experts = block.experts
        assert experts.w2.dtype == torch.int8 and all(len(o.token_ids) == 8 for o in outs)
        held = dequantize(experts.w2.detach().cpu(), experts.w2_scale.detach().cpu(), None, torch.float64)
        assert ((held - want.double()).abs() <= experts.w2_scale.detach().cpu().double().unsqueeze(-1) / 2 + 1e-9).all(), f"seed={seed}"
