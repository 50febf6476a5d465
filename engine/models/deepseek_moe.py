"""The DeepSeek-style MoE layer plan, shared by GLM-4.5, dots.llm1 and the DeepSeek-V2/V3 families.

The first ``first_k_dense_replace`` layers (or those ``mlp_layer_types`` calls "dense": MiMo-V2-Flash, Hy3) are
dense SwiGLU MLPs of ``intermediate_size``; every other layer is a sparse block of ``n_routed_experts`` experts of ``moe_intermediate_size`` plus
``n_shared_experts`` ungated shared experts (one MLP of their summed width), routed as ``moe_routing``
reads from the config.

``biased_sigmoid_moe`` is the sparse layer of the families that route this way without expert groups (Hy3,
MiniMax-M3, Step-3.7-Flash): bias-corrected sigmoid top-k, renormalised and scaled, beside one shared expert.
"""

from torch import nn

from engine.distributed.collectives import SINGLE, TensorParallel
from engine.layers.mlp import GatedMLP
from engine.layers.moe import SparseMoeBlock
from engine.core.model_config import ModelConfig
from moe_kernels import RoutingSpec
from moe_kernels.activation import SILU, ExpertActivation

# Checkpoint names of this plan -> ours: the shared experts are our one ungated shared expert, and the
# correction bias lives on the MoE block rather than on its router.
DEEPSEEK_MOE_ALIASES: tuple[tuple[str, str], ...] = (
    (".mlp.shared_experts.", ".mlp.shared_expert."),
    (".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias"),
)


def moe_routing(config: ModelConfig) -> tuple[RoutingSpec, bool]:
    """The routing of a DeepSeek-style config, and whether it has a correction bias.

    ``scoring_func`` (default sigmoid: GLM-4.5, dots.llm1, DeepSeek-V3; softmax for DeepSeek-V2) and ``topk_method``: "noaux_tc"
    (or none given: GLM, dots) is the bias-corrected grouped top-k with groups scored by their top-2 sum;
    "group_limited_greedy" (DeepSeek-V2) scores groups by their best expert, without a bias; "greedy"
    ignores the groups.
    """
    method = config.cfg("topk_method") or "noaux_tc"
    if method not in ("noaux_tc", "group_limited_greedy", "greedy"):
        raise ValueError(f"unsupported topk_method {method!r}")
    n_group = int(config.cfg("n_group") or 1) if method != "greedy" else 1
    v2 = config.architecture == "DeepseekV2ForCausalLM"  # softmax scores; its router ignores norm_topk_prob
    spec = RoutingSpec(
        top_k=config.cfg("num_experts_per_tok"),
        scoring=config.cfg("scoring_func") or ("softmax" if v2 else "sigmoid"),
        renormalize=not v2 and bool(config.cfg("norm_topk_prob", False)),
        n_group=n_group,
        topk_group=int(config.cfg("topk_group") or 1) if n_group > 1 else 1,
        group_scoring="max" if method == "group_limited_greedy" else "top2_sum",
        scaling_factor=float(config.cfg("routed_scaling_factor", 1.0) or 1.0),
    )
    return spec, method == "noaux_tc"


def is_dense_layer(config: ModelConfig, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` has a dense MLP: below ``first_k_dense_replace``, or "dense" in
    ``mlp_layer_types`` where the config lists each layer's kind."""
    kinds = config.cfg("mlp_layer_types")
    if kinds:
        return kinds[layer_idx] == "dense"
    return layer_idx < (config.cfg("first_k_dense_replace") or 0)


def deepseek_mlp(config: ModelConfig, layer_idx: int, moe_backend: str, tp: TensorParallel = SINGLE) -> nn.Module:
    """Layer ``layer_idx``'s MLP: dense (``is_dense_layer``), else routed plus shared experts."""
    if is_dense_layer(config, layer_idx):
        return GatedMLP(config.hidden_size, config.cfg("intermediate_size"), tp)
    routing, correction_bias = moe_routing(config)
    inter = config.cfg("moe_intermediate_size")
    return SparseMoeBlock(
        config.hidden_size,
        num_experts=config.cfg("n_routed_experts"),
        routing=routing,
        intermediate_size=inter,
        backend=moe_backend,
        shared_expert_size=inter * (config.cfg("n_shared_experts") or 0),
        shared_expert_gated=False,
        correction_bias=correction_bias,
        router_float32=True,
        tp=tp,
    )


def biased_sigmoid_moe(config: ModelConfig, moe_backend: str, tp: TensorParallel, *, num_experts: int,
                       intermediate_size: int, shared_expert_size: int, scaling_factor: float,
                       activation: ExpertActivation = SILU,
                       shared_activation: ExpertActivation | None = None) -> SparseMoeBlock:
    """The sparse layer of Hy3, MiniMax-M3 and Step-3.7-Flash, whose configs name its sizes each their own way.

    The router (float32, as the checkpoints store and run it) keeps the top ``num_experts_per_tok`` of sigmoid
    scores plus a correction bias; the kept experts' uncorrected scores are renormalised and scaled by
    ``scaling_factor``. Beside them one ungated shared expert of ``shared_expert_size`` (none at 0) applies
    ``shared_activation`` (by default the experts' ``activation``).
    """
    moe = SparseMoeBlock(
        config.hidden_size,
        num_experts=num_experts,
        routing=RoutingSpec(top_k=config.cfg("num_experts_per_tok"), scoring="sigmoid", renormalize=True,
                            scaling_factor=scaling_factor),
        intermediate_size=intermediate_size,
        backend=moe_backend,
        shared_expert_size=shared_expert_size,
        shared_expert_gated=False,
        correction_bias=True,
        router_float32=True,
        tp=tp,
        activation=activation,
    )
    if moe.shared_expert is not None:
        moe.shared_expert.activation = activation if shared_activation is None else shared_activation
    return moe
