"""Qwen3.5-MoE's text model: Qwen3-Next's layer plan with the linear layers' projections kept apart
(``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``), every layer's MLP sparse and its router's
top-k weights always renormalised. Its rope sections
(``mrope_section``) only differ from plain RoPE for image and video positions: text positions are equal in
every section."""

from engine.models.hybrid import HybridCausalLM


class Qwen3_5MoeForCausalLM(HybridCausalLM):
    deltanet_layout = "split"
    renormalize = True


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    """The published image-text checkpoints, served as their text model: the language model's tensors sit under
    ``model.language_model.``, the vision tower's (``model.visual.``) are skipped, and the config's
    ``text_config`` is the model's (``engine.core.model_config``)."""

    name_aliases = (("model.language_model.", "model."),)

    def extra_layer(self, name: str) -> bool:
        return name.startswith("model.visual.") or super().extra_layer(name)
