"""DeepSeek-V4 (``deepseek_v4``): per-layer attention kinds over a sliding window (``layer_types``: sliding only,
compressed sparse attention with a lightning indexer, or heavily compressed attention;
``engine.layers.compressed_attention``), a residual of ``hc_mult`` streams joined by manifold-constrained
hyper-connections (``engine.layers.hyper_connections``), and MoE layers whose first ones route by a token-id hash
(``mlp_layer_types``; ``engine.layers.clamped_moe``). Checkpoints in transformers' layout (what
``save_pretrained`` writes); the next-token-prediction layers (``mtp.*``) are not loaded.

Sliding-only layers rotate with the "main" rope; compressed layers, their compressors and indexer with the
"compress" rope (``rope_parameters`` keyed so). The engine's metadata carries no window for this family: each
layer applies its own window to the key rows its per-request state keeps (``linear_layers``: every attention layer
keeps one, in the state slots hybrid models use), and reads its compressed entries from its blocks.

Tensor parallel: each layer's query heads split over the ranks (its shared key=value row, compressors and indexer
whole on each: ``engine.layers.compressed_attention``), the experts and the shared expert by intermediate slices
as DeepSeek-V3's (``engine.layers.clamped_moe``), the embeddings and head by vocabulary rows; the
hyper-connections (per token and cheap) run whole on every rank over the same streams.
"""

import logging
import re

import torch
from torch import nn

from engine.core.model_config import CheckpointError, ModelConfig
from engine.device_batch.attention_metadata import AttentionMetadata
from engine.layers.clamped_moe import ClampedMoeBlock
from engine.layers.compressed_attention import CSA, HCA, SLIDING, CompressedAttention, Float32RMSNorm, Rope
from engine.layers.hyper_connections import HyperConnection, HyperHead
from engine.layers.rotary import RotaryEmbedding
from engine.models.base import MoECausalLM, WeightRule

logger = logging.getLogger(__name__)

# The published layout (DeepSeek's names, which transformers' save_pretrained writes too, under ``model.``) ->
# transformers' module names, which ours follow. In order; each applied wherever it matches.
PUBLISHED_NAMES: tuple[tuple[str, str], ...] = (
    (r"^(?:model\.)?embed\.weight$", "model.embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^(?:model\.)?hc_head[._](fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"^(?:model\.)?hc_head\.hc_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^layers\.", "model.layers."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.self_attn\.indexer\.compressor\.", ".self_attn.compressor.indexer."),
    (r"\.self_attn\.indexer\.(weights_proj|wq_b)\.", r".self_attn.compressor.indexer.\1."),
    (r"\.indexer\.scorer\.weights_proj\.", ".indexer.weights_proj."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn_sink$", ".sinks"),
    (r"(\.self_attn\.(?:.*\.)?)norm\.weight$", r"\1kv_norm.weight"),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
)


def v4_rope(config: ModelConfig, label: str) -> Rope:
    """The "main" or "compress" rope of ``rope_parameters`` (transformers' formulas for a scaled type)."""
    hf = config.hf_config
    params = hf.rope_parameters[label]
    dim = int(config.head_dim * params.get("partial_rotary_factor", 1.0))
    kind = params.get("rope_type", "default")
    if kind == "default":
        exponents = torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim  # (models build on meta)
        return Rope(1.0 / (float(params["rope_theta"]) ** exponents), 1.0, dim)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind not in ROPE_INIT_FUNCTIONS or kind == "dynamic":
        raise CheckpointError(f"config.json rope_parameters[{label!r}]: rope_type {kind!r} is not supported")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](hf, torch.device("cpu"), layer_type=label)
    return Rope(inv_freq, scaling, dim)


class NoRopeTables(RotaryEmbedding):
    """The base class's shared rope, unused here (the family's ropes differ per layer kind: ``v4_rope``): no
    tables are built (at a million positions they would take gigabytes)."""

    def __init__(self, config: ModelConfig, head_dim: int, max_positions: int) -> None:
        nn.Module.__init__(self)
        self.config, self.head_dim, self.max_positions = config, head_dim, max_positions

    def build_cache(self) -> None:
        pass


class V4DecoderLayer(nn.Module):
    """Attention then MoE, each between a hyper-connection's collapse and merge of the streams [T, n, H]."""

    def __init__(self, config: ModelConfig, self_attn: CompressedAttention, mlp: ClampedMoeBlock) -> None:
        super().__init__()
        c = config
        eps = c.rms_norm_eps
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = Float32RMSNorm(c.hidden_size, eps)
        self.post_attention_layernorm = Float32RMSNorm(c.hidden_size, eps)
        hc = (c.cfg("hc_mult"), c.hidden_size, c.cfg("hc_sinkhorn_iters"), c.cfg("hc_eps"), eps)
        self.attn_hc, self.ffn_hc = HyperConnection(*hc), HyperConnection(*hc)

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """streams [T, n, H] -> [T, n, H]."""
        post, comb, x = self.attn_hc(streams)
        streams = HyperConnection.merge(streams, self.self_attn(self.input_layernorm(x), positions, meta), post, comb)
        post, comb, x = self.ffn_hc(streams)
        return HyperConnection.merge(streams, self.mlp(self.post_attention_layernorm(x), input_ids), post, comb)


class DeepseekV4ForCausalLM(MoECausalLM):
    # Every attention tensor keeps its name (no packed qkv; the compressors' gate_proj is not an MLP's); the
    # experts and the shared expert's gate/up pack as every family's.
    weight_rules = (WeightRule(r"^(.*\.self_attn\..*)$", r"\1"),)
    rotary_class = NoRopeTables
    # Its attention runs a Python loop over the requests: no CUDA graphs.
    eager_only = True

    def __init__(self, config: ModelConfig, moe_backend: str, max_positions: int, **kwargs) -> None:
        kinds = list(config.cfg("layer_types") or [])
        if len(kinds) != config.num_layers or any(k not in (SLIDING, CSA, HCA) for k in kinds):
            raise CheckpointError(f"config.json layer_types: need {config.num_layers} entries of {SLIDING}, {CSA} "
                                  f"or {HCA}, got {kinds!r}")
        if config.num_kv_heads != 1:
            raise CheckpointError("config.json num_key_value_heads: DeepSeek-V4 attention has one shared key=value "
                                  f"head, got {config.num_kv_heads}")
        if bool(config.cfg("attention_bias")) or bool(config.cfg("mlp_bias")):
            raise CheckpointError("config.json attention_bias / mlp_bias: biases are not supported for DeepSeek-V4")
        self._ropes = {label: v4_rope(config, label) for label in ("main", "compress")}
        super().__init__(config, moe_backend, max_positions, **kwargs)
        self.model.hc_head = HyperHead(config.cfg("hc_mult"), config.hidden_size, config.cfg("hc_eps"),
                                       config.rms_norm_eps)
        self.model.norm = Float32RMSNorm(config.hidden_size, config.rms_norm_eps)
        mtp = int(config.cfg("num_nextn_predict_layers") or 0)
        if mtp:
            logger.info("DeepSeek-V4: %d next-token-prediction (MTP) layer(s) in the checkpoint are not loaded "
                        "(speculative decoding with them is not served)", mtp)

    def build_layer(self, layer_idx: int, rotary: RotaryEmbedding, moe_backend: str) -> V4DecoderLayer:
        c = self.config
        kind = c.cfg("layer_types")[layer_idx]
        rates = c.cfg("compress_rates") or {}
        index = dict(heads=c.cfg("index_n_heads"), head_dim=c.cfg("index_head_dim"), topk=c.cfg("index_topk"))
        attn = CompressedAttention(
            kind, c.hidden_size, c.num_heads, c.head_dim, c.cfg("q_lora_rank"), c.cfg("o_groups"),
            c.cfg("o_lora_rank"), c.cfg("sliding_window"), self._ropes["main" if kind == SLIDING else "compress"],
            c.rms_norm_eps, rate=int(rates.get(kind, 0)), index=index, tp=self.tp,
        )
        mlp_kind = (c.cfg("mlp_layer_types") or ["moe"] * c.num_layers)[layer_idx]
        if mlp_kind not in ("moe", "hash_moe"):
            raise CheckpointError(f"config.json mlp_layer_types[{layer_idx}]: {mlp_kind!r} is not supported")
        inter = c.cfg("moe_intermediate_size")
        mlp = ClampedMoeBlock(c.hidden_size, c.cfg("n_routed_experts"), c.cfg("num_experts_per_tok"), inter, inter,
                              float(c.cfg("swiglu_limit")), c.cfg("scoring_func"),
                              float(c.cfg("routed_scaling_factor") or 1.0),
                              c.vocab_size if mlp_kind == "hash_moe" else None, self.tp)
        return V4DecoderLayer(c, attn, mlp)

    def linear_layers(self) -> list[CompressedAttention]:
        """The layers keeping a per-request state (``engine.worker.state_cache``): every attention layer, whose
        state holds its window's key rows and its compressors' open windows (``CompressedAttention.state_spec``)."""
        return [layer.self_attn for layer in self.local_layers()]

    def layers_cache_alike(self) -> bool:
        return False  # each layer kind caches its own row widths

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids [T], positions [T] -> hidden [T, H]."""
        x = self.model.embed_tokens(input_ids)  # [T, H]
        streams = x[:, None].expand(-1, self.config.cfg("hc_mult"), -1).contiguous()  # [T, n, H]
        for layer in self.local_layers():
            streams = layer(streams, input_ids, positions, meta)
        return self.model.norm(self.model.hc_head(streams))

    def map_weight_name(self, name: str):
        for pattern, replacement in PUBLISHED_NAMES:
            name = re.sub(pattern, replacement, name)
        return super().map_weight_name(name)

    def extra_layer(self, name: str) -> bool:
        return name.startswith(("mtp.", "model.mtp.")) or super().extra_layer(name)
