"""Models of real size with RANDOM weights, built from a real config without downloading anything.

For measuring speed only: the weights are random, so the text is random. A
spec names a built-in preset (the key numbers of a published config.json) or
a path to a config.json (or its directory), optionally followed by
``:key=value,...`` overrides of config fields, e.g.::

    qwen3-30b-a3b                                   # the real shape (30.5B parameters)
    gpt-oss-120b                                    # 116.8B parameters, 5.1B active
    qwen3-30b-a3b:num_hidden_layers=2,hidden_size=64,num_experts=8,vocab_size=512   # CPU tests
    /path/to/config.json

Weights are created on the target device in the target dtype (meta-device
construction, then ``to_empty`` and a fill one tensor at a time): a real-size
model never has a CPU copy and no transformers model is built. Each weight is
drawn from (seed, its checkpoint name) and cut to a rank's slice by the
checkpoint loader's own slicing, so a model split over ranks (tensor or expert
parallel) holds exactly the slices of the unsplit model of the same spec and
seed, and generates the same greedy tokens.
"""

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from engine.distributed.collectives import SINGLE, TensorParallel
from engine.distributed.pipeline import WHOLE, PipelineStage
from engine.layers.moe import SparseMoeBlock
from engine.layers.norms import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.core.model_config import (IMAGE_ARCHITECTURES, SUPPORTED_ARCHITECTURES, CheckpointError, ModelConfig,
                                      model_config_from_hf)
from engine.loading.model_loader import copy_into, held_elsewhere, part_of, rank_part
from engine.loading.quantization import quantize_experts_
from engine.models import MoECausalLM, model_class
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
    # zai-org/GLM-4.5-Air: 106B parameters, 12B active (the card counts neither the embeddings nor the MTP layer).
    "glm-4.5-air": dict(
        architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", vocab_size=151552, hidden_size=4096,
        intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=46, num_attention_heads=96,
        num_key_value_heads=8, head_dim=128, partial_rotary_factor=0.5, n_routed_experts=128, n_shared_experts=1,
        num_experts_per_tok=8, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True,
        first_k_dense_replace=1, num_nextn_predict_layers=1, attention_bias=True, use_qk_norm=False,
        max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        pad_token_id=151329, eos_token_id=[151329, 151336, 151338], torch_dtype="bfloat16",
    ),
    # MiniMaxAI/MiniMax-M2: 230B parameters, 10B active (without the embeddings).
    "minimax-m2": dict(
        architectures=["MiniMaxM2ForCausalLM"], model_type="minimax_m2", vocab_size=200064, hidden_size=3072,
        intermediate_size=1536, num_hidden_layers=62, num_attention_heads=48, num_key_value_heads=8, head_dim=128,
        rotary_dim=64, num_local_experts=256, num_experts_per_tok=8, max_position_embeddings=196608,
        rope_theta=5000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=200034,
        eos_token_id=200020, torch_dtype="bfloat16",
    ),
    # openai/gpt-oss-20b: 20.91B parameters, 3.61B active (the model card counts the unembedding, not the
    # embedding lookup). Windowed (128) and full attention alternate (sliding first, the config's default
    # ``layer_types``); the published experts are MXFP4.
    "gpt-oss-20b": dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=201088, hidden_size=2880,
        intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        num_local_experts=32, num_experts_per_tok=4, sliding_window=128,  # layer_types: the config's default
        max_position_embeddings=131072,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                             truncate=False, original_max_position_embeddings=4096),
        rms_norm_eps=1e-5, swiglu_limit=7.0, attention_bias=True, tie_word_embeddings=False,
        eos_token_id=200002, pad_token_id=199999, torch_dtype="bfloat16",
    ),
    # deepseek-ai/DeepSeek-V3 (and R1, V3.1; Kimi-K2 and Moonlight share the architecture): 671B parameters,
    # 37B active; MLA (a 576-value latent per token and layer), 3 dense layers, 256 routed + 1 shared expert.
    "deepseek-v3": dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280, hidden_size=7168,
        intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
        num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5,
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
        n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True,
        max_position_embeddings=163840, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=1.0, mscale_all_dim=1.0, beta_fast=32,
            beta_slow=1, original_max_position_embeddings=4096),
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16",
    ),
    # deepseek-ai/DeepSeek-V2-Lite: 15.7B parameters, 2.4B active; no q LoRA, softmax greedy routing.
    "deepseek-v2-lite": dict(
        architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=102400, hidden_size=2048,
        intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
        num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, routed_scaling_factor=1.0,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
        topk_method="greedy", n_group=1, topk_group=1, num_experts_per_tok=6, first_k_dense_replace=1,
        norm_topk_prob=False, max_position_embeddings=163840, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=0.707, mscale_all_dim=0.707, beta_fast=32,
            beta_slow=1, original_max_position_embeddings=4096),
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=100000, eos_token_id=100001,
        torch_dtype="bfloat16",
    ),
}
# deepseek-ai/DeepSeek-V3.2(-Exp): DeepSeek-V3's shape plus DeepSeek Sparse Attention's lightning indexer (64
# heads of 128, each query attending to its top 2,048 tokens).
PRESETS["deepseek-v3.2"] = dict(PRESETS["deepseek-v3"], architectures=["DeepseekV32ForCausalLM"],
                                model_type="deepseek_v32", index_n_heads=64, index_head_dim=128, index_topk=2048)
# openai/gpt-oss-120b: 116.83B parameters, 5.13B active: the 20b's layers, 36 of them, 128 experts each.
PRESETS["gpt-oss-120b"] = dict(PRESETS["gpt-oss-20b"], num_hidden_layers=36, num_local_experts=128)

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
    if arch in IMAGE_ARCHITECTURES:
        raise CheckpointError(f"random weights {spec!r}: {arch} (an image-text model) is served from a checkpoint "
                              "only")
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


def _tensor_seed(seed: int, name: str) -> int:
    """The generator seed of checkpoint tensor ``name``: a stable hash of (seed, name), the same in every process
    (Python's ``hash`` of a str is salted per process)."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _checkpoint_tensors(whole: MoECausalLM) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, full shape) of every tensor a checkpoint of ``whole`` (the unsplit model, on meta) would hold, named
    as the loader reads them: q/k/v and gate/up unpacked, routed experts one tensor per expert and projection."""
    for name, param in whole.named_parameters():
        shape = tuple(param.shape)
        stem, _, leaf = name.rpartition(".")
        if stem.endswith(".qkv_proj"):  # [q + kv + v, H] (or [q + kv + v] for a bias): each layer's own widths
            attn = whole.get_submodule(stem[:-len(".qkv_proj")])
            for proj, rows in (("q", attn.q_size), ("k", attn.kv_size), ("v", attn.v_size)):
                yield f"{stem[:-len('qkv_proj')]}{proj}_proj.{leaf}", (rows, *shape[1:])
        elif stem.endswith(".gate_up_proj"):  # [2I, H]
            for proj in ("gate", "up"):
                yield f"{stem[:-len('gate_up_proj')]}{proj}_proj.{leaf}", (shape[0] // 2, shape[1])
        elif name.endswith(".experts.w13"):  # [E, 2I, H]
            for e in range(shape[0]):
                for proj in ("gate", "up"):
                    yield f"{stem}.{e}.{proj}_proj.weight", (shape[1] // 2, shape[2])
        elif name.endswith(".experts.w2"):  # [E, H, I]
            for e in range(shape[0]):
                yield f"{stem}.{e}.down_proj.weight", shape[1:]
        else:
            yield name, shape


class _Draws:
    """Full-size tensors drawn from (seed, name) on the target device, cut to this rank's part by the checkpoint
    loader's own slicing (``rank_part``): what a checkpoint of the unsplit random model would give this rank."""

    def __init__(self, model: MoECausalLM, whole: MoECausalLM, seed: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.model, self.seed, self.dtype, self.device = model, seed, dtype, device
        self.gen = torch.Generator(device=device)
        # Norm weights start at 1 (as in every family's init): their names in the whole model are the rank's.
        self.norms = {f"{name}.weight" for name, m in whole.named_modules() if isinstance(m, RMSNorm)}

    def full(self, name: str, target: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Checkpoint tensor ``name`` (``target``: the parameter it fills), whole, in the target dtype."""
        if target in self.norms:
            return torch.ones(shape, dtype=self.dtype, device=self.device)
        if name.endswith(".bias"):
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.gen.manual_seed(_tensor_seed(self.seed, name))
        return torch.empty(shape, dtype=self.dtype, device=self.device).normal_(0.0, INIT_STD, generator=self.gen)

    def part(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name`` (the whole one drawn, then cut)."""
        target, rule, _ = self.model.map_weight_name(name)
        full = self.full(name, target, shape)
        index = rank_part(target, rule, list(shape), self.model)
        return full if index is None else part_of(full, index)


@torch.no_grad()
def _fill_quantized_experts_(block_name: str, block: SparseMoeBlock, hidden: int, inter: int, draws: _Draws) -> None:
    """This rank's 8-bit experts of one MoE block (``inter``: the unsplit expert intermediate size): each expert's
    part drawn in the model dtype and quantized as the checkpoint path quantizes it (per expert, on this rank's
    part), so only one expert is ever in 16 bits."""
    experts = block.experts
    for local in range(experts.w13.shape[0]):
        stem = f"{block_name}.experts.{block.first_expert + local}"
        gate, up = (draws.part(f"{stem}.{proj}_proj.weight", (inter, hidden)) for proj in ("gate", "up"))
        down = draws.part(f"{stem}.down_proj.weight", (hidden, inter))
        for name, halves, w in (("w13", 2, torch.cat([gate, up])), ("w2", 1, down)):  # [2I_r, H], [H, I_r]
            q, scale = quantize(w, experts.scheme, halves)
            getattr(experts, name)[local].copy_(q)
            getattr(experts, f"{name}_scale")[local].copy_(scale)


def _experts_block(target: str) -> str | None:
    """The MoE block whose routed experts parameter ``target`` is (``...mlp.experts.w13`` -> ``...mlp``), else None."""
    if target.endswith((".experts.w13", ".experts.w2")):
        return target.rsplit(".experts.", 1)[0]
    return None


@torch.no_grad()
def _init_(model: MoECausalLM, whole: MoECausalLM, device: torch.device, seed: int, dtype: torch.dtype) -> None:
    """Fill this rank's parameters with its parts of the unsplit model's weights (``whole``, on meta)."""
    draws = _Draws(model, whole, seed, dtype, device)
    params = dict(model.named_parameters())
    quantized = {name: m for name, m in model.named_modules()
                 if isinstance(m, SparseMoeBlock) and m.experts.scheme is not None}
    written = {name: 0 for name in params}
    for name, shape in _checkpoint_tensors(whole):
        if model.on_other_stage(name):  # another pipeline stage's
            continue
        target, rule, match = model.map_weight_name(name)
        if held_elsewhere(target, rule, match, model) or _experts_block(target) in quantized:
            continue  # another rank's experts; 8-bit experts are filled below
        written[target] += copy_into(params[target].data, draws.part(name, shape), rule, match, model, name,
                                     "random weights")
    for block_name, block in quantized.items():
        _, inter2, hidden = whole.get_submodule(f"{block_name}.experts").w13.shape  # [E, 2I, H]
        _fill_quantized_experts_(block_name, block, hidden, inter2 // 2, draws)
        for name, param in block.experts.named_parameters(prefix=f"{block_name}.experts"):
            written[name] = param.numel()
    # A parameter the tensor list missed (a family it does not know) would keep to_empty's garbage: refuse.
    unfilled = [n for n, p in params.items() if written[n] < p.numel()]
    if unfilled:
        raise RuntimeError(f"random weights left parameters unfilled: {', '.join(unfilled[:4])}")


def build_random_model(config: ModelConfig, dtype: torch.dtype, device: torch.device, moe_backend: str,
                       max_positions: int, seed: int = 0, quantization: QuantScheme | None = None,
                       tp: TensorParallel = SINGLE, stage: PipelineStage = WHOLE) -> MoECausalLM:
    """Our family class for ``config`` with random weights, allocated and filled on ``device`` in ``dtype``.

    ``device="meta"`` builds the shapes only (parameter counts of real-size models, no memory).
    ``quantization``: the routed experts are allocated 8-bit and filled one quantized expert at a time.
    ``tp``: this rank's slices only, cut from the unsplit model's weights exactly as a checkpoint's are.

    Every weight is a function of (``seed``, its checkpoint name) alone: each is drawn whole, one tensor at a
    time, on ``device`` and cut to this rank's part, so the ranks of any split hold exactly the slices of the
    unsplit model of the same seed. Transiently one full-size tensor (the largest is usually the embeddings or
    the LM head; one expert's projection for the routed experts, with 8-bit experts its gate and up parts
    joined besides) is on the device beside this rank's model; no copy is ever made on the CPU. The draws are
    the same on GPUs of one model (CUDA lays a draw out by the GPU's multiprocessor count: GPUs of other
    models give other weights for the same seed). Under tensor
    parallelism 8-bit experts are quantized from each rank's part, as with a checkpoint.
    """
    cls = model_class(config)
    with torch.device("meta"):
        model = cls(config, moe_backend=moe_backend, max_positions=max_positions, tp=tp, stage=stage)
    quantize_experts_(model, quantization)  # on meta: 8-bit shapes, before any memory is taken
    model = model.to(dtype=dtype).to_empty(device=device)  # the cast is free on meta; memory comes once
    if config.tie_word_embeddings and stage.is_first:  # to_empty may give the two names separate storage
        model.lm_head.weight = model.model.embed_tokens.weight
    if device.type != "meta":
        for module in model.modules():  # non-persistent buffers were meta, now uninitialised: rebuild them
            if isinstance(module, RotaryEmbedding):
                module.build_cache()
            elif isinstance(module, SparseMoeBlock):
                module.expert_tokens.zero_()
        with torch.device("meta"):  # the unsplit model's names and full shapes, no memory
            whole = cls(config, moe_backend="torch", max_positions=1)
        _init_(model, whole, device, seed, dtype)
        if device.type == "cuda":  # the drawn tensors' cached blocks: give them back before the KV pool is sized
            torch.cuda.empty_cache()
        logger.warning(
            "RANDOM WEIGHTS: %s with %.2fB parameters on %s/%s%s; its output is random text (for speed measurements "
            "only)", config.architecture, sum(p.numel() for p in model.parameters()) / 1e9, device, dtype,
            f" (rank {tp.rank} of {tp.size})" if tp.size > 1 else "",
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
