"""Adapter directories written by hand (adapter_config.json + safetensors), well-formed or broken one way each:
what ``check_adapter_dir`` must accept or refuse, as ``load_adapter`` does."""

import json
import os
import random

import torch
from safetensors.torch import save_file

HIDDEN, EXPERTS, EXPERT_SIZE = 8, 4, 6
LAYER = "base_model.model.model.layers.0"


def write_adapter(path: str, rank: int = 2, config: dict | None = None, tensors: dict | None = None) -> str:
    """A plain LoRA adapter at ``path``: q_proj and o_proj, and the fused routed experts (PEFT's nesting of two
    target_parameters), random factors; ``config`` entries override the config's, ``tensors`` the weights'
    (a value None drops that tensor)."""
    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(random.randrange(2**31))
    weights = {
        f"{LAYER}.self_attn.q_proj.lora_A.weight": torch.randn(rank, HIDDEN, generator=g),
        f"{LAYER}.self_attn.q_proj.lora_B.weight": torch.randn(HIDDEN, rank, generator=g),
        f"{LAYER}.self_attn.o_proj.lora_A.weight": torch.randn(rank, HIDDEN, generator=g),
        f"{LAYER}.self_attn.o_proj.lora_B.weight": torch.randn(HIDDEN, rank, generator=g),
        f"{LAYER}.mlp.experts.base_layer.lora_A.weight": torch.randn(EXPERTS * rank, HIDDEN, generator=g),
        f"{LAYER}.mlp.experts.base_layer.lora_B.weight": torch.randn(2 * EXPERT_SIZE, rank * EXPERTS, generator=g),
        f"{LAYER}.mlp.experts.lora_A.weight": torch.randn(EXPERTS * rank, EXPERT_SIZE, generator=g),
        f"{LAYER}.mlp.experts.lora_B.weight": torch.randn(HIDDEN, rank * EXPERTS, generator=g),
    }
    for key, value in (tensors or {}).items():
        if value is None:
            weights.pop(key, None)
        else:
            weights[key] = value
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "o_proj"],
           "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], "bias": "none",
           "base_model_name_or_path": "tiny-moe", "use_dora": False, "modules_to_save": None}
    cfg.update(config or {})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    if weights:
        save_file(weights, os.path.join(path, "adapter_model.safetensors"))
    else:
        save_file({}, os.path.join(path, "adapter_model.safetensors"))
    return path


def _with(rows: int, cols: int, value: float) -> torch.Tensor:
    """Small random factors [rows, cols] with one entry set to ``value``, at a random place."""
    t = torch.randn(rows, cols) * 0.1
    t.view(-1)[random.randrange(rows * cols)] = value
    return t


def _remove(name):
    def go(path):
        os.remove(os.path.join(path, name))
    return go


def _overwrite(name, data: bytes):
    def go(path):
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
    return go


# name -> (how the well-formed adapter is broken: config overrides, tensor overrides, a step after writing), and
# the words the one-line refusal holds.
MALFORMED = {
    "no_config": ({}, {}, _remove("adapter_config.json"), "no adapter_config.json"),
    "no_weights": ({}, {}, _remove("adapter_model.safetensors"), "no adapter_model.safetensors"),
    "bad_json": ({}, {}, _overwrite("adapter_config.json", b'{"peft_type": "LORA", "r": '), "not readable JSON"),
    "not_lora": ({"peft_type": "IA3"}, {}, None, "peft_type must be LORA"),
    "dora": ({"use_dora": True}, {}, None, "use_dora"),
    "bias": ({"bias": "all"}, {}, None, "bias"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, {}, None, "modules_to_save"),
    "rank_pattern": ({"rank_pattern": {"q_proj": 8}}, {}, None, "rank_pattern"),
    "bad_rank": ({"r": 0}, {}, None, "r must be a positive integer"),
    "missing_b": ({}, {f"{LAYER}.self_attn.q_proj.lora_B.weight": None}, None, "lora_B missing"),
    "bias_tensor": ({}, {f"{LAYER}.self_attn.q_proj.lora_B.bias": torch.zeros(HIDDEN)}, None, "unexpected tensor"),
    "embeddings": ({}, {"base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(2, HIDDEN),
                        "base_model.model.model.embed_tokens.lora_B.weight": torch.zeros(HIDDEN, 2)}, None,
                   "not supported"),
    "shape_mismatch": ({}, {f"{LAYER}.self_attn.q_proj.lora_B.weight": torch.zeros(HIDDEN, 3)}, None, "do not match"),
    "damaged_weights": ({}, {}, _overwrite("adapter_model.safetensors", b"\xff" * 20), "cannot be read"),
    # Values: the refusal names the tensor. Non-finite anywhere, one huge value, or a scaling that makes B huge.
    "nan_weights": ({}, {f"{LAYER}.self_attn.o_proj.lora_B.weight": _with(HIDDEN, 2, float("nan"))}, None,
                    f"tensor '{LAYER}.self_attn.o_proj.lora_B.weight' holds nan"),
    "inf_weights": ({}, {f"{LAYER}.mlp.experts.lora_A.weight": _with(EXPERTS * 2, EXPERT_SIZE, float("-inf"))}, None,
                    f"tensor '{LAYER}.mlp.experts.lora_A.weight' holds -inf"),
    "huge_weights": ({}, {f"{LAYER}.self_attn.q_proj.lora_A.weight": _with(2, HIDDEN, 1e30)}, None,
                     f"tensor '{LAYER}.self_attn.q_proj.lora_A.weight' holds a value of 1e+30"),
    "huge_scaling": ({"lora_alpha": 1e9}, {}, None, "times the scaling 5e+08"),
    "nan_alpha": ({"lora_alpha": float("nan")}, {}, None, "lora_alpha must be a finite number"),
}


def write_malformed(path: str, case: str) -> str:
    config, tensors, after, _ = MALFORMED[case]
    write_adapter(path, config=config, tensors=tensors)
    if after is not None:
        after(path)
    return path
