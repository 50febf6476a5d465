"""Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``) with images: Qwen3-MoE's text layers under M-RoPE,
the vision tower's features in place of the image placeholder tokens' embeddings, and its deepstack features
added to those tokens' hidden states after the first text layers (``engine.models.qwen_image_text``)."""

from collections.abc import Callable

import torch

from engine.layers.rotary import RotaryEmbedding
from engine.models.base import DecoderLayer
from engine.models.qwen3_moe import Qwen3MoeForCausalLM
from engine.models.qwen_image_text import QwenImageText
from engine.models.qwen_moe import qwen_mlp


class Qwen3VLMoeForConditionalGeneration(QwenImageText, Qwen3MoeForCausalLM):
    name_aliases = (("model.language_model.", "model."), ("model.visual.", "visual."))

    def build_layer(self, layer_idx: int, rotary: RotaryEmbedding, moe_backend: str) -> DecoderLayer:
        layer = super().build_layer(layer_idx, rotary, moe_backend)
        # its router always renormalises the top-k weights (the config has no norm_topk_prob)
        layer.mlp = qwen_mlp(self.config, layer_idx, moe_backend, tp=self.tp, renormalize=True)
        return layer

    def checkpoint_layout(self, name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """Published checkpoints store the packed experts transposed ([E, H, 2I] and [E, I, H]); a tensor already
        in our layout (what transformers saves) is read as it is, which is also how transformers reads a square
        one."""
        if name.endswith("mlp.experts.gate_up_proj"):
            ours = (2 * self.config.cfg("moe_intermediate_size"), self.config.hidden_size)
        elif name.endswith("mlp.experts.down_proj"):
            ours = (self.config.hidden_size, self.config.cfg("moe_intermediate_size"))
        else:
            return None
        return lambda t: t if tuple(t.shape[1:]) == ours else t.transpose(1, 2).contiguous()
