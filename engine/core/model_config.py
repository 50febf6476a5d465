"""What the engine needs to know about a checkpoint, read from its config.json via transformers."""

import json
import os
from dataclasses import dataclass, field
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be served; the message names the file."""


SUPPORTED_ARCHITECTURES = (
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
    "Glm4MoeForCausalLM",
    "Dots1ForCausalLM",
    "MiniMaxM2ForCausalLM",
    "GptOssForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "MiMoV2FlashForCausalLM",
    "HYV3ForCausalLM",
    "KimiLinearForCausalLM",
    "DeepseekV32ForCausalLM",
    "GlmMoeDsaForCausalLM",
    "Step3p7ForConditionalGeneration",
    "MiniMaxM3SparseForConditionalGeneration",
    "DeepseekV4ForCausalLM",
    "Kimi_K25ForConditionalGeneration",
    "KimiK25ForConditionalGeneration",
)

# Image-text checkpoints served as their text model: the engine reads their config's ``text_config``.
TEXT_PART_ARCHITECTURES = ("Qwen3_5MoeForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
                           "Step3p7ForConditionalGeneration", "MiniMaxM3SparseForConditionalGeneration",
                           "Kimi_K25ForConditionalGeneration", "KimiK25ForConditionalGeneration")
# Of those, the ones served with images: ``ModelConfig.multimodal_config`` keeps their whole config. Kimi-K2.5 by
# both its names: transformers' class (what ``save_pretrained`` writes) and the published checkpoints' own.
IMAGE_ARCHITECTURES = ("Qwen3VLMoeForConditionalGeneration", "Kimi_K25ForConditionalGeneration",
                       "KimiK25ForConditionalGeneration")
# Served with images when config.json has a ``vision_config`` (every published Qwen3.5-MoE checkpoint), as their
# text model otherwise.
VISION_CONFIG_IMAGE_ARCHITECTURES = ("Qwen3_5MoeForConditionalGeneration",)


def serves_images(architecture: str, raw: dict, language_model_only: bool = False) -> bool:
    """Whether a checkpoint of ``architecture`` whose config.json reads ``raw`` is served with images
    (``language_model_only``: only if it cannot be served as text)."""
    return architecture in IMAGE_ARCHITECTURES or (
        not language_model_only and architecture in VISION_CONFIG_IMAGE_ARCHITECTURES
        and isinstance(raw.get("vision_config"), dict))

# model_type of checkpoints whose config class ships as remote code -> the transformers config it is: Kimi-K2
# is the DeepSeek-V3 architecture (``architectures``: DeepseekV3ForCausalLM).
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}


@dataclass(slots=True)
class ModelConfig:
    """Normalised view of a Hugging Face config. ``hf_config`` keeps the original object."""

    architecture: str
    hf_config: Any
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: list[int] = field(default_factory=list)
    sliding_window: int | None = None  # the window of every layer
    torch_dtype: str = "float32"
    # Models whose layers differ (``layer_types``: gpt-oss, MiMo-V2-Flash, Step-3.7-Flash): the window of the layers
    # in ``sliding_layers`` only.
    layer_sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    # Hybrid models (Qwen3-Next, Qwen3.5): the layers with linear attention (a fixed-size state per request
    # instead of K and V per token); empty for every other family.
    linear_layers: tuple[int, ...] = ()
    # Image-text models served with images (``serves_images``): the checkpoint's whole transformers config
    # (its ``vision_config`` and image token ids); ``hf_config`` is then its text model's.
    multimodal_config: Any = None

    @property
    def is_hybrid(self) -> bool:
        return bool(self.linear_layers)

    def cfg(self, name: str, default: Any = None) -> Any:
        return getattr(self.hf_config, name, default)

    def own_window(self, layer_idx: int) -> int | None:
        """The window layer ``layer_idx`` has on its own (beyond ``sliding_window``), or None."""
        return self.layer_sliding_window if layer_idx in self.sliding_layers else None


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def load_model_config(model_dir: str, language_model_only: bool = False) -> ModelConfig:
    """Read and validate ``config.json``; one-line CheckpointError for anything unservable.
    ``language_model_only``: ``EngineConfig.language_model_only``."""
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"{model_dir}: not a directory (give a local checkpoint directory)")
    path = os.path.join(model_dir, "config.json")
    raw = _read_json(path)
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(
            f"{path}: unsupported architecture {archs or raw.get('model_type')!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    from transformers import AutoConfig

    try:
        if raw.get("model_type") in MODEL_TYPE_ALIASES:  # a config class transformers only has as remote code
            fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map", "transformers_version")}
            hf = AutoConfig.for_model(MODEL_TYPE_ALIASES[raw["model_type"]], **fields)
        else:
            hf = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:  # transformers raises many types for a bad config
        raise CheckpointError(f"{path}: cannot be parsed by transformers: {str(e).splitlines()[0]}") from None

    eos = raw.get("eos_token_id")
    whole = hf
    if arch in TEXT_PART_ARCHITECTURES:
        hf = hf.get_text_config()
        if getattr(hf, "quantization_config", None) is None and getattr(whole, "quantization_config", None):
            hf.quantization_config = whole.quantization_config  # stated once for the whole model (Kimi-K2.5)
        eos = eos if eos is not None else getattr(hf, "eos_token_id", None)
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(gen_path):
        eos = _read_json(gen_path).get("eos_token_id", eos)
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    dtype = str(getattr(hf, "dtype", None) or raw.get("torch_dtype") or "float32")
    config = model_config_from_hf(arch, hf, eos_ids, torch_dtype=dtype)
    if serves_images(arch, raw, language_model_only):
        config.multimodal_config = whole
        # the whole model's setting ties its LM head (transformers reads that one, not the text config's)
        config.tie_word_embeddings = bool(getattr(whole, "tie_word_embeddings", False))
    return config


def _dots1_window(hf: Any) -> int | None:
    """dots.llm1 lists each layer's attention; its published checkpoints attend fully in every layer."""
    kinds = set(getattr(hf, "layer_types", None) or ["full_attention"])
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"}:
        return getattr(hf, "sliding_window", None)
    raise CheckpointError("dots.llm1 with both sliding and full attention layers (layer_types / max_window_layers) "
                          "is not supported: every layer must attend the same way")


def model_config_from_hf(arch: str, hf: Any, eos_ids: list[int], torch_dtype: str = "float32") -> ModelConfig:
    """Normalise a transformers config object (read from a checkpoint, or built in memory) into a ModelConfig."""
    if getattr(hf, "per_layer_config", None):
        # Per-layer overrides (Step-3.7-Flash's sliding layers' head count): transformers refuses the global value
        # unless asked; it is the layers' without an override, and a family reads the overrides itself.
        hf.allow_global_per_layer_attribute_access = True
    num_heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    if "rope_theta" not in rope:
        rope["rope_theta"] = getattr(hf, "rope_theta", 10000.0)
    eos_ids = [t for t in eos_ids if 0 <= t < hf.vocab_size]
    sliding = getattr(hf, "sliding_window", None)
    if arch == "Qwen2MoeForCausalLM" and not getattr(hf, "use_sliding_window", False):
        sliding = None
    if arch in ("OlmoeForCausalLM", "Glm4MoeForCausalLM", "MiniMaxM2ForCausalLM", "Qwen3NextForCausalLM",
                "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"):
        sliding = None  # full attention in every layer, whatever the config says
    if arch == "Dots1ForCausalLM":
        sliding = _dots1_window(hf)
    if arch == "DeepseekV4ForCausalLM":
        sliding = None  # every layer applies its window itself: its compressor reads the whole context
    layer_types = list(getattr(hf, "layer_types", None) or [])
    sliding_layers = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    layer_window = None
    if arch in ("GptOssForCausalLM", "MiMoV2FlashForCausalLM", "Step3p7ForConditionalGeneration"):
        # gpt-oss, MiMo-V2-Flash and Step-3.7-Flash mix windowed and full layers: the window is per layer, never
        # the whole model's.
        layer_window, sliding = (sliding or None) if sliding_layers else None, None
    return ModelConfig(
        architecture=arch,
        hf_config=hf,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        rope_parameters=rope,
        max_position_embeddings=getattr(hf, "max_position_embeddings", 4096),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        eos_token_ids=eos_ids,
        sliding_window=sliding or None,
        torch_dtype=torch_dtype.replace("torch.", ""),
        layer_sliding_window=layer_window,
        sliding_layers=sliding_layers if layer_window else (),
        linear_layers=tuple(i for i, kind in enumerate(layer_types) if kind == "linear_attention"),
    )
