"""What every family shares: the decoder stack, the weight-name table, logits.

A family file says how to build one layer's attention and MLP from the
config, and lists how checkpoint names map onto our packed parameters.
"""

import abc
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from engine.distributed.collectives import SINGLE, TensorParallel
from engine.distributed.pipeline import WHOLE, PipelineStage
from engine.device_batch.attention_metadata import AttentionMetadata
from engine.layers.attention import Attention
from engine.layers.norms import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.core.model_config import CheckpointError, ModelConfig


@dataclass(frozen=True, slots=True)
class WeightRule:
    """A checkpoint tensor name -> (our parameter name, where in it the tensor goes).

    ``shard``: None (whole tensor), "q"/"k"/"v" (rows of a packed qkv),
    0/1 (gate/up half of a packed gate_up, or of every expert's rows of w13 from
    a stack of all experts' gates or ups, Step-3.7-Flash), or "expert" (one
    expert's slice; with ``half`` 0/1 for w13, None for w2).
    """

    pattern: str
    target: str
    shard: str | int | None = None
    half: int | None = None


# Order matters: the first matching rule wins, so expert rules precede dense ones.
COMMON_WEIGHT_RULES: tuple[WeightRule, ...] = (
    WeightRule(r"^(.*)\.experts\.(\d+)\.(?:gate_proj|w1)\.weight$", r"\1.experts.w13", "expert", 0),
    WeightRule(r"^(.*)\.experts\.(\d+)\.(?:up_proj|w3)\.weight$", r"\1.experts.w13", "expert", 1),
    WeightRule(r"^(.*)\.experts\.(\d+)\.(?:down_proj|w2)\.weight$", r"\1.experts.w2", "expert"),
    # Already-packed expert tensors (transformers 5 in-memory layout): same shapes as ours.
    WeightRule(r"^(.*)\.experts\.gate_up_proj$", r"\1.experts.w13"),
    WeightRule(r"^(.*)\.experts\.down_proj$", r"\1.experts.w2"),
    WeightRule(r"^(.*)\.q_proj\.(weight|bias)$", r"\1.qkv_proj.\2", "q"),
    WeightRule(r"^(.*)\.k_proj\.(weight|bias)$", r"\1.qkv_proj.\2", "k"),
    WeightRule(r"^(.*)\.v_proj\.(weight|bias)$", r"\1.qkv_proj.\2", "v"),
    WeightRule(r"^(.*)\.gate_proj\.weight$", r"\1.gate_up_proj.weight", 0),
    WeightRule(r"^(.*)\.up_proj\.weight$", r"\1.gate_up_proj.weight", 1),
    WeightRule(r"^(.*)$", r"\1"),
)


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)).

    The residual sum is carried between layers unfinished: a layer returns its
    MLP output and the running sum before it, and the next norm adds the two
    as it normalizes (one fused pass when the norms are fused).
    """

    def __init__(self, config: ModelConfig, self_attn: Attention, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H]: the last layer's MLP output (the embeddings at layer 0, with residual None).

        Returns (this layer's MLP output, the residual sum it adds to).
        """
        q, k, v, residual = self.pre_attention(x, residual, positions)
        return self.post_attention(self.self_attn.attend(q, k, v, meta), residual)

    # The forward in two halves around the attention core, for piecewise CUDA graphs: each half is
    # fixed-shape per token (captured), the core between them is not.
    def pre_attention(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor):
        """-> q [T, h, d], k, v [T, kvh, d], and the residual sum before attention [T, H]."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        return *self.self_attn.project(h, positions), residual

    def post_attention(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """attn [T, h, d], the attention core's output -> (this layer's MLP output, the residual sum)."""
        h, residual = self.post_attention_layernorm(self.self_attn.output(attn), residual)
        return self.mlp(h), residual


class VocabParallelEmbedding(nn.Module):
    """Token embeddings, split by vocabulary rows over the tensor-parallel ranks.

    Rank r holds rows [r * V_local, (r + 1) * V_local) (the last rank's tail past the
    vocabulary is zero padding); ids outside a rank's rows look up zeros there, so the sum
    over the ranks (one all-reduce) is every token's embedding.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // tp.size)  # V_local
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return nn.functional.embedding(input_ids, self.weight)  # [T, H]
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)  # [T, H]
        return self.tp.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))


class OnOtherStage(nn.Module):
    """A layer (or the embedding, head or final norm) another pipeline stage holds: no parameters here, so
    the checkpoint names of the layers this stage holds stay those of the whole model."""


class DecoderStack(nn.Module):
    """``model.*`` in the checkpoint: embeddings, layers, final norm (each ``OnOtherStage`` where another
    pipeline stage holds it: the embedding on the first stage, the final norm on the last)."""

    def __init__(self, config: ModelConfig, layers: list[nn.Module], tp: TensorParallel = SINGLE,
                 stage: PipelineStage = WHOLE) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp) \
            if stage.is_first else OnOtherStage()
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if stage.is_last else OnOtherStage()


class MoECausalLM(nn.Module, abc.ABC):
    """Base of every family. ``forward(input_ids[T], positions[T], meta) -> hidden[T, H]``."""

    # Family-specific renames applied to checkpoint names before COMMON_WEIGHT_RULES.
    name_aliases: tuple[tuple[str, str], ...] = ()
    # Family-specific rules tried before COMMON_WEIGHT_RULES.
    weight_rules: tuple[WeightRule, ...] = ()
    # The rotary embedding every layer shares (M-RoPE for image-text models).
    rotary_class: type[RotaryEmbedding] = RotaryEmbedding
    # Whether the model reads a request's images (``engine.core.prompt_images``): the runner then puts
    # ``image_step(...)`` in each batch's metadata and calls ``forget_images`` for finished requests.
    takes_images = False

    def __init__(self, config: ModelConfig, moe_backend: str, max_positions: int, tp: TensorParallel = SINGLE,
                 stage: PipelineStage = WHOLE) -> None:
        """``tp``: this rank's tensor-parallel group; layers hold only this rank's slices of the weights.
        ``stage``: this rank's pipeline stage; only its layers are built (the others are ``OnOtherStage``)."""
        super().__init__()
        self.config = config
        self.tp = tp
        self.stage = stage
        rotary = self.rotary_class(config, config.head_dim, max_positions)
        layers = [self.build_layer(i, rotary, moe_backend) if stage.holds_layer(i) else OnOtherStage()
                  for i in range(config.num_layers)]
        self.model = DecoderStack(config, layers, tp, stage)
        # Vocabulary-parallel like the embeddings: each rank computes its rows' logits, then they are gathered.
        # The first stage holds it beside the embedding (tied or not): it samples (engine.distributed.pipeline).
        if stage.is_first:
            self.lm_head = nn.Linear(config.hidden_size, self.model.embed_tokens.rows, bias=False)
            if config.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = OnOtherStage()

    @abc.abstractmethod
    def build_layer(self, layer_idx: int, rotary: RotaryEmbedding, moe_backend: str) -> DecoderLayer:
        """One decoder layer of this family."""

    def checkpoint_layout(self, name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """How checkpoint tensor ``name``, read whole, becomes the layout of the parameter it maps to (before
        this rank's part is cut from it), or None when it already has that layout (most families)."""
        return None

    def local_layers(self) -> list[DecoderLayer]:
        """The decoder layers this rank holds (every layer unless pipelined)."""
        return [layer for layer in self.model.layers if not isinstance(layer, OnOtherStage)]

    def attention_layers(self) -> list[nn.Module]:
        """Each local layer's attention: an ``Attention`` or an ``MLAttention`` (both expose ``cache_spec()``)."""
        return [layer.self_attn for layer in self.local_layers()]

    def layers_cache_alike(self) -> bool:
        """Whether every layer of the whole model, this pipeline stage's or not, caches the same per-token shape on
        this rank (what ``engine.worker.cache_groups`` needs to let two layers share cache tensors). True unless a
        family's layers differ (MiMo-V2-Flash)."""
        return True

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank caches (all of them without tensor parallelism)."""
        return self.attention_layers()[0].num_kv_heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.run_layers(self.model.embed_tokens(input_ids), None, positions, meta)  # [T, H]
        return self.final_norm(x, residual)

    def run_layers(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                   meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's layers over x [T, H] (the embeddings, residual None, on the first stage; what the stage
        before sent elsewhere) -> (the last layer's MLP output, the residual sum), each [T, H]."""
        for layer in self.local_layers():
            x, residual = layer(x, residual, positions, meta)
        return x, residual

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """hidden [T, H]: the final norm over the last layer's output plus the residual sum."""
        return self.model.norm(x, residual)[0] if residual is not None else self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()  # [N, V_local]
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits, dim=-1)[:, :self.config.vocab_size]  # [N, V]

    def on_other_stage(self, name: str) -> bool:
        """True for a checkpoint tensor another pipeline stage holds (another stage's layer, or the embedding,
        LM head or final norm off this stage): this rank never reads it. Image models also say so of their vision
        tower's tensors on every tensor-parallel rank but rank 0 (``engine.models.image_features``)."""
        if not self.stage.pipelined:
            return False
        match = _LAYER_INDEX.match(name)
        if match is not None:
            return not self.stage.holds_layer(int(match.group(1)))
        if name.startswith(("model.embed_tokens.", "lm_head.")):
            return not self.stage.is_first
        if name.startswith("model.norm."):
            return not self.stage.is_last
        return False

    def extra_layer(self, name: str) -> bool:
        """True for a checkpoint tensor of a layer past ``num_hidden_layers``: the next-token-prediction (MTP)
        layers that GLM-4.5 and DeepSeek-V3 checkpoints carry for speculative decoding, not served here."""
        match = _LAYER_INDEX.match(name)
        return match is not None and int(match.group(1)) >= self.config.num_layers

    def map_weight_name(self, name: str) -> tuple[str, WeightRule, re.Match]:
        for old, new in self.name_aliases:
            name = name.replace(old, new)
        for rule in (*self.weight_rules, *COMMON_WEIGHT_RULES):
            match = re.match(rule.pattern, name)
            if match:
                return match.expand(rule.target), rule, match
        raise AssertionError("the catch-all rule always matches")


def layer_kind_rotary(model: MoECausalLM, kind: str, max_positions: int, family: str,
                      **defaults: float) -> RotaryEmbedding:
    """The rope of one layer kind, for families whose ``rope_parameters`` are keyed by layer type (each kind its own
    theta and rotated width): built once per model and shared by the layers of that kind. ``defaults``: parameters
    the family's configs may leave out. Only the default rope type: another is a CheckpointError naming ``family``."""
    rotaries = model.__dict__.setdefault("_rotaries", {})
    if kind not in rotaries:
        params = dict(model.config.rope_parameters.get(kind) or {})
        if params.get("rope_type", "default") != "default":
            raise CheckpointError(f"config.json rope_parameters[{kind!r}]: rope_type "
                                  f"{params['rope_type']!r} is not supported for {family} (only default)")
        for key, value in defaults.items():
            params.setdefault(key, value)
        rotaries[kind] = RotaryEmbedding(replace(model.config, rope_parameters=params), model.config.head_dim,
                                         max_positions)
    return rotaries[kind]
