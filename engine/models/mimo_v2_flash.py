"""MiMo-V2-Flash (``mimo_v2_flash``): sliding-window and full-attention layers (``layer_types``, 5:1 in the
published model); the sliding layers have twice the KV heads and a learned sink per query head. Every layer's q
and k heads (``head_dim``) are wider than its v heads (``v_head_dim``), the values are scaled by
``attention_value_scale``, and each layer kind has its own rope (``rope_parameters`` keyed by layer type, a
partial rotary factor). Dense first layers (``mlp_layer_types``), then DeepSeek-V3's bias-corrected sigmoid
routing without shared experts. The next-token-prediction layers (``model.mtp.*``) are not loaded."""

from engine.layers.attention import Attention
from engine.layers.rotary import RotaryEmbedding
from engine.models.base import DecoderLayer, MoECausalLM, layer_kind_rotary
from engine.models.deepseek_moe import DEEPSEEK_MOE_ALIASES, deepseek_mlp

SLIDING = "sliding_attention"


class MiMoV2FlashForCausalLM(MoECausalLM):
    # The published checkpoints call the sinks ``attention_sink_bias``.
    name_aliases = ((".self_attn.attention_sink_bias", ".self_attn.sinks"), *DEEPSEEK_MOE_ALIASES)

    def build_layer(self, layer_idx: int, rotary: RotaryEmbedding, moe_backend: str) -> DecoderLayer:
        c = self.config
        kind = c.cfg("layer_types")[layer_idx]
        sliding = kind == SLIDING
        scale = c.cfg("attention_value_scale")
        attn = Attention(
            c.hidden_size, c.num_heads, c.num_kv_heads * (2 if sliding else 1), c.head_dim,
            self._rotary(kind, rotary.max_positions), c.rms_norm_eps, tp=self.tp,
            qkv_bias=bool(c.cfg("attention_bias", False)), sinks=sliding, sliding_window=c.own_window(layer_idx),
            v_head_dim=c.cfg("v_head_dim"), v_scale=1.0 if scale is None else float(scale),
        )
        return DecoderLayer(c, attn, deepseek_mlp(c, layer_idx, moe_backend, tp=self.tp))

    def _rotary(self, kind: str, max_positions: int) -> RotaryEmbedding:
        """The rope of one layer kind (its own theta), shared by the layers of that kind; transformers' default
        partial rotary factor for this family."""
        return layer_kind_rotary(self, kind, max_positions, "MiMo-V2-Flash", partial_rotary_factor=0.334)

    def layers_cache_alike(self) -> bool:
        # A sliding layer has twice the full layers' KV heads: alike only where both come to one per rank (fewer
        # KV heads than ranks are replicated, one per rank, as ``Attention`` does).
        def local(kv_heads: int) -> int:
            return kv_heads // self.tp.size if kv_heads >= self.tp.size else 1
        return local(self.config.num_kv_heads) == local(2 * self.config.num_kv_heads)

    def extra_layer(self, name: str) -> bool:
        return name.startswith("model.mtp.") or super().extra_layer(name)
