"""Qwen3.5-MoE: Qwen3-Next's layer plan with the linear layers' projections kept apart (``in_proj_qkv``,
``in_proj_z``, ``in_proj_b``, ``in_proj_a``), every layer's MLP sparse and its router's top-k weights always
renormalised.

The published checkpoints are image-text models (``Qwen3_5MoeForConditionalGeneration``): the language model's
tensors under ``model.language_model.``, the vision tower's under ``model.visual.``, the text model's config
under ``text_config``. With a ``vision_config`` (``ModelConfig.multimodal_config``) they are served with images:
Qwen3-VL's tower without deepstack taps, its features in place of the image placeholders, interleaved M-RoPE over
the rotated quarter of each head (``engine.models.qwen_image_text``). Without one, as their text model, whose rope
sections (``mrope_section``) only differ from plain RoPE for image positions: text positions are equal in every
section."""

from engine.models.hybrid import HybridCausalLM
from engine.models.qwen_image_text import QwenImageText


class Qwen3_5MoeForCausalLM(HybridCausalLM):
    deltanet_layout = "split"
    renormalize = True


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    """An image-text checkpoint without a vision config, served as its text model: the vision tower's tensors
    (``model.visual.``), if any, are skipped."""

    name_aliases = (("model.language_model.", "model."),)

    def extra_layer(self, name: str) -> bool:
        return name.startswith("model.visual.") or super().extra_layer(name)


class Qwen3_5MoeWithImages(QwenImageText, Qwen3_5MoeForCausalLM):
    """``Qwen3_5MoeForConditionalGeneration`` with a vision config: served with images (split tensor parallel
    as its text model, the tower on rank 0)."""

    name_aliases = (("model.language_model.", "model."), ("model.visual.", "visual."))
