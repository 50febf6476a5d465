"""What each kind of model is not served with yet, checked at start (plain Python): one table.

Each ``FamilyLimits`` names the models it covers (a predicate over the checkpoint's ``ModelConfig``), how the
refusal names them, and the settings not yet built or tested with them. A setting asked for that a row lists is
refused at start in one line naming its flag (``moegate serve`` exits 2 before anything is written), rather than
served wrongly. ``engine.core.config_rules`` holds the rules between settings; these are the rules between a
setting and the model, which that table cannot see.

- Hybrid linear attention (Qwen3-Next, Qwen3.5-MoE, Kimi-Linear): their linear layers keep one state per running
  request instead of K and V per token, and what moves or rolls back K and V per token does not do so for those
  states yet; tensor parallelism splits their linear layers' heads (Gated DeltaNet's, Kimi Delta Attention's)
  over the ranks. The prefix cache serves them through state checkpoints (``engine.core.state_checkpoints``).
- Sparse attention (DeepSeek-V3.2, GLM-5, MiniMax-M3): an indexer key per token beside the latent (MiniMax-M3's
  beside K and V), and GLM-5's layers hand their selection to the next. The prefix cache, chunked prefill,
  preemption and n-gram speculation are served. They split tensor parallel with their indexer whole on every rank
  (each caches every token's indexer key and computes the same selection): DeepSeek-V3.2's and GLM-5's MLA heads
  over the ranks as DeepSeek-V3's, MiniMax-M3's GQA heads as any GQA model's, its experts as MiniMax-M2's.
- DeepSeek-V4: its compressed layers cache their compressed entries per token; every layer keeps its window's key
  rows and its compressors' open windows in a state per request (``engine.layers.compressed_attention``), served
  through the hybrid models' state slots and checkpoints, so what moves or rolls back K and V per token does not
  move or roll back that state. It splits tensor parallel: the query heads (and their output groups) over the
  ranks, the shared key=value row, compressors and indexer whole on every rank (so is the state: none of it is
  per head), the experts as DeepSeek-V3's, the hyper-connections whole.
- Image-text models served with images (Qwen3-VL-MoE, Qwen3.5-MoE with a vision config, Kimi-K2.5): split tensor
  parallel as their text families, the vision tower and encoder cache on rank 0, which hands each step's image rows
  to the other ranks (``engine.models.image_step``); the image rows are not carried across pipeline stages or
  through expert parallelism yet (the model itself also refuses a pipelined or expert-parallel build).
- Step-3.7-Flash: checked on one rank and split tensor parallel; its per-head output gates, each layer kind's own
  query head count and clamped SwiGLUs are not yet checked through the other splits or under adapters.
"""

from collections.abc import Callable
from dataclasses import dataclass

from engine.core.config import EngineConfig
from engine.core.model_config import ModelConfig

Asked = Callable[[EngineConfig], bool]


def flag(field: str) -> str:
    """The command-line flag of an ``EngineConfig`` field (``engine.engine_flags`` derives them the same way)."""
    return "--" + field.replace("_", "-")


@dataclass(frozen=True)
class FamilyLimits:
    """The settings the models ``covers`` accepts are not served with yet: (field, is it asked for?, why)."""

    covers: Callable[[ModelConfig], bool]
    name: str  # how the refusal names them: a ``str.format`` template over ``{architecture}``
    unsupported: tuple[tuple[str, Asked, str], ...]


def _pp(c: EngineConfig) -> bool:
    return c.pipeline_parallel_size > 1


def _dp(c: EngineConfig) -> bool:
    return c.data_parallel_size > 1


def _ep(c: EngineConfig) -> bool:
    return c.enable_expert_parallel


def _eplb(c: EngineConfig) -> bool:
    return c.enable_eplb


def _tp(c: EngineConfig) -> bool:
    return c.tensor_parallel_size > 1


def _role(c: EngineConfig) -> bool:
    return c.role != "both"


def _host(c: EngineConfig) -> bool:
    return c.host_cache_gb > 0


def _disk(c: EngineConfig) -> bool:
    return c.disk_cache_dir is not None


def _lora(c: EngineConfig) -> bool:
    return c.lora_enabled


# Hybrid families whose linear layers split their heads over tensor-parallel ranks (Gated DeltaNet, Kimi Delta
# Attention).
TENSOR_PARALLEL_HYBRIDS = ("Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration",
                           "KimiLinearForCausalLM")
SPARSE_ATTENTION_ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM",
                                  "MiniMaxM3SparseForConditionalGeneration")

# The families whose cache has an FP8 layout (``engine.layers.fp8_cache``).
FP8_CACHE_ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")

LIMITS = (
    FamilyLimits(lambda m: m.architecture not in FP8_CACHE_ARCHITECTURES, "{architecture}", (
        ("kv_cache_dtype", lambda c: c.kv_cache_dtype != "auto",
         "an FP8 cache is built for DeepSeek-V3.2's and GLM-5's sparse attention only"),
    )),
    FamilyLimits(lambda m: m.is_hybrid, "hybrid linear-attention models ({architecture})", (
        ("pipeline_parallel_size", _pp, "the stages do not carry state slots yet"),
        ("data_parallel_size", _dp, "replicas sharing experts are not built for them yet"),
        ("enable_expert_parallel", _ep, "expert parallelism is not built for them yet"),
        ("speculative", lambda c: c.speculative is not None, "rejected drafts cannot be rolled back out of a state"),
        ("role", _role, "a KV handoff does not carry the states yet"),
        ("host_cache_gb", _host, "the prefix-cache tiers hold no state checkpoints yet"),
        ("disk_cache_dir", _disk, "the prefix-cache tiers hold no state checkpoints yet"),
        ("enable_lora", _lora, "adapters are not applied to the linear layers yet"),
        ("enable_eplb", _eplb, "expert parallelism is not built for them yet"),
    )),
    FamilyLimits(lambda m: m.is_hybrid and m.architecture not in TENSOR_PARALLEL_HYBRIDS,
                 "hybrid linear-attention models ({architecture})", (
        ("tensor_parallel_size", _tp, "the linear layers' heads are not split yet"),
    )),
    FamilyLimits(lambda m: m.architecture in SPARSE_ATTENTION_ARCHITECTURES, "sparse-attention models ({architecture})", (
        ("pipeline_parallel_size", _pp, "a layer's selection is not handed across stages yet"),
        ("data_parallel_size", _dp, "replicas sharing experts are not tested with them yet"),
        ("enable_expert_parallel", _ep, "expert parallelism is not tested with them yet"),
        ("enable_eplb", _eplb, "expert parallelism is not tested with them yet"),
        ("speculative", lambda c: c.speculative not in (None, "ngram"), "only n-gram drafts are tested with them yet"),
        ("role", _role, "a KV handoff of the indexer keys is not tested yet"),
        ("host_cache_gb", _host, "the prefix-cache tiers are not tested with the indexer keys yet"),
        ("disk_cache_dir", _disk, "the prefix-cache tiers are not tested with the indexer keys yet"),
        ("enable_lora", _lora, "adapters are not applied to sparse attention yet"),
    )),
    FamilyLimits(lambda m: m.architecture == "DeepseekV4ForCausalLM", "DeepSeek-V4 ({architecture})", (
        ("pipeline_parallel_size", _pp, "the hyper-connection streams are not handed across stages yet"),
        ("data_parallel_size", _dp, "replicas sharing experts are not built for it yet"),
        ("enable_expert_parallel", _ep, "expert parallelism is not built for it yet"),
        ("enable_eplb", _eplb, "expert parallelism is not built for it yet"),
        ("quantization", lambda c: c.quantization is not None, "its clamped experts run unquantized (a torch loop)"),
        ("speculative", lambda c: c.speculative is not None, "rejected drafts cannot be rolled back out of its state"),
        ("role", _role, "a KV handoff does not carry its per-request state yet"),
        ("host_cache_gb", _host, "the prefix-cache tiers hold no state checkpoints yet"),
        ("disk_cache_dir", _disk, "the prefix-cache tiers hold no state checkpoints yet"),
        ("enable_lora", _lora, "adapters are not applied to its attention or experts yet"),
    )),
    FamilyLimits(lambda m: m.multimodal_config is not None, "{architecture}", (
        ("pipeline_parallel_size", _pp, "image rows are not handed across stages yet (tensor parallelism is "
                                        "served: --tensor-parallel-size N)"),
        ("enable_expert_parallel", _ep, "expert parallelism is not built for it yet (tensor parallelism and "
                                        "independent replicas are: moegate serve --data-parallel-size N without it)"),
        ("data_parallel_size", _dp, "replicas sharing experts are not built for it yet"),
        ("enable_eplb", _eplb, "expert parallelism is not built for it yet"),
    )),
    FamilyLimits(lambda m: m.architecture == "Step3p7ForConditionalGeneration", "{architecture}", (
        ("pipeline_parallel_size", _pp, "its stages are not tested yet"),
        ("data_parallel_size", _dp, "replicas sharing experts are not tested with it yet"),
        ("enable_expert_parallel", _ep, "expert parallelism is not tested with it yet"),
        ("enable_eplb", _eplb, "expert parallelism is not tested with it yet"),
        ("enable_lora", _lora, "adapters are not tested with its gated attention yet"),
    )),
)


def check_family_support(config: EngineConfig, model: ModelConfig) -> None:
    """ValueError, one line naming the flag, for the first setting ``model`` is not served with yet."""
    for limits in LIMITS:
        if not limits.covers(model):
            continue
        for field, asked, why in limits.unsupported:
            if asked(config):
                name = limits.name.format(architecture=model.architecture)
                raise ValueError(f"{flag(field)} is not supported with {name} yet: {why}")
