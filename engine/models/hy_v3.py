"""Tencent Hy3 (``hy_v3``): GQA with RMSNorm on each head of q and k, q/k/v and o_proj biases with
``attention_bias``; dense first layers (``mlp_layer_types``), then sparse layers whose router takes the top k
of sigmoid scores plus a correction bias, renormalises the uncorrected scores and scales them by
``router_scaling_factor``, beside ungated shared experts."""

from torch import nn

from engine.core.model_config import CheckpointError, ModelConfig
from engine.distributed.collectives import SINGLE, TensorParallel
from engine.layers.mlp import GatedMLP
from engine.layers.rotary import RotaryEmbedding
from engine.models.base import DecoderLayer, MoECausalLM
from engine.models.deepseek_moe import biased_sigmoid_moe, is_dense_layer
from engine.models.dots1 import qk_norm_attention


def hy_v3_mlp(config: ModelConfig, layer_idx: int, moe_backend: str, tp: TensorParallel = SINGLE) -> nn.Module:
    """Layer ``layer_idx``'s MLP: dense where ``mlp_layer_types`` says so, else routed plus shared experts."""
    if config.cfg("mlp_bias", False):
        raise CheckpointError("config.json mlp_bias=true is not supported for Hy3 (its published checkpoints have "
                              "no MLP biases)")
    if is_dense_layer(config, layer_idx):
        return GatedMLP(config.hidden_size, config.cfg("intermediate_size"), tp)
    inter = config.cfg("moe_intermediate_size")
    return biased_sigmoid_moe(config, moe_backend, tp, num_experts=config.cfg("num_experts"), intermediate_size=inter,
                              shared_expert_size=inter * (config.cfg("num_shared_experts") or 0),
                              scaling_factor=float(config.cfg("router_scaling_factor", 1.0)))


class HYV3ForCausalLM(MoECausalLM):
    # The published names (``router.gate``, ``expert_bias``, ``shared_mlp``) and transformers' in-memory ones
    # (``gate``, ``e_score_correction_bias``, ``shared_experts``) -> ours: the shared experts are our one
    # ungated shared expert, the correction bias sits on the MoE block.
    name_aliases = (
        (".mlp.router.gate.", ".mlp.gate."),
        (".mlp.expert_bias", ".mlp.e_score_correction_bias"),
        (".mlp.shared_mlp.", ".mlp.shared_expert."),
        (".mlp.shared_experts.", ".mlp.shared_expert."),
    )

    def build_layer(self, layer_idx: int, rotary: RotaryEmbedding, moe_backend: str) -> DecoderLayer:
        return DecoderLayer(self.config, qk_norm_attention(self.config, rotary, self.tp),
                            hy_v3_mlp(self.config, layer_idx, moe_backend, tp=self.tp))
