"""Models of real size with RANDOM weights, built from a real config without downloading anything.

For measuring speed only: the weights are random, so the text is random. A
spec names a built-in preset (the key numbers of a published config.json) or
a path to a config.json (or its directory), optionally followed by
``:key=value,...`` overrides of config fields, e.g.::

    qwen3-30b-a3b                                   # the real shape (30.5B parameters)
    qwen3-30b-a3b:num_hidden_layers=2,hidden_size=64,num_experts=8,vocab_size=512   # CPU tests
    /path/to/config.json

Weights are created on the target device in the target dtype (meta-device
construction, then ``to_empty`` and in-place init with a device generator):
a real-size model never has a CPU copy and no transformers model is built.
"""

import json
import logging
import os
from typing import Any

import torch

from engine.layers.moe import ExpertWeights, SparseMoeBlock
from engine.layers.norms import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.loading.model_config import SUPPORTED_ARCHITECTURES, CheckpointError, ModelConfig, model_config_from_hf
from engine.loading.quantization import quantize_experts_
from engine.models import MODEL_REGISTRY, MoECausalLM
from moe_kernels.quant import QuantScheme, quantize

logger = logging.getLogger(__name__)

# Key numbers of the published config.json files (architecture, sizes, routing, rope, special tokens).
PRESETS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3-30B-A3B: 30.5B parameters, 3.3B active.
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, bos_token_id=151643,
        eos_token_id=151645, torch_dtype="bfloat16",
    ),
    # allenai/OLMoE-1B-7B-0924: 6.9B parameters, 1.3B active.
    "olmoe-1b-7b": dict(
        architectures=["OlmoeForCausalLM"], model_type="olmoe", vocab_size=50304, hidden_size=2048,
        intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
        num_experts=64, num_experts_per_tok=8, norm_topk_prob=False, max_position_embeddings=4096,
        rope_theta=10000.0, rms_norm_eps=1e-5, clip_qkv=None, tie_word_embeddings=False, attention_bias=False,
        bos_token_id=None, eos_token_id=50279, pad_token_id=1, torch_dtype="bfloat16",
    ),
    # Qwen/Qwen1.5-MoE-A2.7B: 14.3B parameters, 2.7B active (60 routed experts + a shared one).
    "qwen1.5-moe-a2.7b": dict(
        architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", vocab_size=151936, hidden_size=2048,
        intermediate_size=5632, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
        num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16, num_experts=60,
        num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=8192, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        use_sliding_window=False, bos_token_id=151643, eos_token_id=151643, torch_dtype="bfloat16",
    ),
    # mistralai/Mixtral-8x7B-v0.1: 46.7B parameters, 12.9B active (93 GB in bf16: an H200, not an H100).
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=32000, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-5, sliding_window=None, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        torch_dtype="bfloat16",
    ),
}

INIT_STD = 0.02  # every preset's initializer_range


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # a bare string such as a rope type


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """Split ``NAME_OR_PATH[:key=value,...]`` into the base and its overrides (no I/O)."""
    base, overrides = spec, {}
    head, sep, tail = spec.rpartition(":")
    if sep and "=" in tail:
        base = head
        for item in tail.split(","):
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise ValueError(f"random weights {spec!r}: override {item!r} is not key=value")
            overrides[key.strip()] = _parse_value(value.strip())
    if not base:
        raise ValueError(f"random weights {spec!r}: name a preset ({', '.join(PRESETS)}) or a config.json path")
    return base, overrides


def _base_fields(base: str) -> dict[str, Any]:
    if base in PRESETS:
        return dict(PRESETS[base])
    path = os.path.join(base, "config.json") if os.path.isdir(base) else base
    if not os.path.isfile(path):
        raise ValueError(f"random weights {base!r}: not a preset ({', '.join(PRESETS)}) nor a config.json file")
    try:
        with open(path) as f:
            fields = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from None
    if not isinstance(fields, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return fields


def random_model_config(spec: str) -> ModelConfig:
    """The ModelConfig a random-weight spec describes; ValueError (one line) for a bad spec."""
    base, overrides = parse_spec(spec)
    fields = {**_base_fields(base), **overrides}
    archs = fields.pop("architectures", None) or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    model_type = fields.pop("model_type", None)
    if arch is None or not model_type:
        raise CheckpointError(f"random weights {spec!r}: needs a model_type and a supported architecture "
                              f"({', '.join(SUPPORTED_ARCHITECTURES)})")
    dtype = str(fields.pop("torch_dtype", None) or fields.pop("dtype", None) or "bfloat16")
    for key in ("transformers_version", "_name_or_path", "auto_map"):
        fields.pop(key, None)
    from transformers import AutoConfig

    try:
        hf = AutoConfig.for_model(model_type, **fields)
    except Exception as e:  # transformers raises many types for a bad config
        raise CheckpointError(f"random weights {spec!r}: transformers rejects the config: {str(e).splitlines()[0]}") from None
    eos = fields.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    return model_config_from_hf(arch, hf, eos_ids, torch_dtype=dtype)


@torch.no_grad()
def _init_quantized_experts_(experts: ExpertWeights, dtype: torch.dtype, gen: torch.Generator) -> None:
    """Random 8-bit experts: each expert drawn in ``dtype`` and quantized, so only one expert is ever in 16 bits."""
    for name, halves in (("w13", 2), ("w2", 1)):
        q, scale = getattr(experts, name), getattr(experts, f"{name}_scale")
        for e in range(q.shape[0]):
            w = torch.empty(q.shape[1:], dtype=dtype, device=q.device).normal_(0.0, INIT_STD, generator=gen)
            q_e, s_e = quantize(w, experts.scheme, halves)
            q[e].copy_(q_e)
            scale[e].copy_(s_e)


@torch.no_grad()
def _init_(model: MoECausalLM, device: torch.device, seed: int, dtype: torch.dtype) -> None:
    gen = torch.Generator(device=device).manual_seed(seed)
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    quantized = set()
    for module in model.modules():
        if isinstance(module, ExpertWeights) and module.scheme is not None:
            _init_quantized_experts_(module, dtype, gen)
            quantized.update(id(p) for p in module.parameters())
    for name, param in model.named_parameters():
        if id(param) in quantized:
            continue
        if id(param) in norm_weights:
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, INIT_STD, generator=gen)  # in place, in the target dtype, on the device


def build_random_model(config: ModelConfig, dtype: torch.dtype, device: torch.device, moe_backend: str,
                       max_positions: int, seed: int = 0, quantization: QuantScheme | None = None) -> MoECausalLM:
    """Our family class for ``config`` with random weights, allocated and filled on ``device`` in ``dtype``.

    ``device="meta"`` builds the shapes only (parameter counts of real-size models, no memory).
    ``quantization``: the routed experts are allocated 8-bit and filled one quantized expert at a time.
    """
    cls = MODEL_REGISTRY[config.architecture]
    with torch.device("meta"):
        model = cls(config, moe_backend=moe_backend, max_positions=max_positions)
    quantize_experts_(model, quantization)  # on meta: 8-bit shapes, before any memory is taken
    model = model.to(dtype=dtype).to_empty(device=device)  # the cast is free on meta; memory comes once
    if config.tie_word_embeddings:  # to_empty may give the two names separate storage
        model.lm_head.weight = model.model.embed_tokens.weight
    if device.type != "meta":
        for module in model.modules():  # non-persistent buffers were meta, now uninitialised: rebuild them
            if isinstance(module, RotaryEmbedding):
                module.build_cache()
            elif isinstance(module, SparseMoeBlock):
                module.expert_tokens.zero_()
        _init_(model, device, seed, dtype)
        logger.warning(
            "RANDOM WEIGHTS: %s with %.2fB parameters on %s/%s; its output is random text (for speed measurements only)",
            config.architecture, sum(p.numel() for p in model.parameters()) / 1e9, device, dtype,
        )
    return model.eval()


def count_parameters(config: ModelConfig) -> tuple[int, int]:
    """(total, active per token) parameters of ``config``'s model, from its shapes (built on meta, no memory).

    Active counts every non-expert parameter plus top-k of the routed experts of each MoE layer.
    """
    model = build_random_model(config, torch.float32, torch.device("meta"), "torch", max_positions=1)
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    for block in model.modules():
        if isinstance(block, SparseMoeBlock):
            num_experts = block.experts.w13.shape[0]
            per_expert = (block.experts.w13.numel() + block.experts.w2.numel()) // num_experts
            inactive += (num_experts - block.top_k) * per_expert
    return total, total - inactive


def served_name(spec: str) -> str:
    """The name a random-weight model is served under: ``random-<preset or config directory>``."""
    base, _ = parse_spec(spec)
    base = base.rstrip("/")
    if base.endswith("config.json"):
        base = os.path.dirname(base) or "config"
    return "random-" + os.path.basename(base)
