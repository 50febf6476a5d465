"""What hybrid linear-attention models (Qwen3-Next, Qwen3.5-MoE) are served with, checked at start (plain Python).

Their linear-attention layers keep one state per running request instead of K and V per token. What moves or
rolls back K and V per token does not do so for those states yet (tensor parallelism splits Gated DeltaNet's
heads, not yet Kimi Delta Attention's): such a setting is refused at start,
in one line naming its flag, rather than served wrongly. The prefix cache serves them through state checkpoints
(``engine.core.state_checkpoints``); speculative decoding stays refused with it on or off.
"""

from engine.core.config import EngineConfig
from engine.core.model_config import ModelConfig

# (EngineConfig field, is it asked for?, why the states do not follow yet)
_UNSUPPORTED = (
    ("pipeline_parallel_size", lambda c: c.pipeline_parallel_size > 1, "the stages do not carry state slots yet"),
    ("data_parallel_size", lambda c: c.data_parallel_size > 1, "replicas sharing experts are not built for them yet"),
    ("enable_expert_parallel", lambda c: c.enable_expert_parallel, "expert parallelism is not built for them yet"),
    ("speculative", lambda c: c.speculative is not None, "rejected drafts cannot be rolled back out of a state"),
    ("role", lambda c: c.role != "both", "a KV handoff does not carry the states yet"),
    ("host_cache_gb", lambda c: c.host_cache_gb > 0, "the prefix-cache tiers hold no state checkpoints yet"),
    ("disk_cache_dir", lambda c: c.disk_cache_dir is not None, "the prefix-cache tiers hold no state checkpoints yet"),
    ("enable_lora", lambda c: c.lora_enabled, "adapters are not applied to the linear layers yet"),
    ("enable_eplb", lambda c: c.enable_eplb, "expert parallelism is not built for them yet"),
)


def flag(field: str) -> str:
    """The command-line flag of an ``EngineConfig`` field (``engine.engine_flags`` derives them the same way)."""
    return "--" + field.replace("_", "-")


# Families whose linear layers split their heads over tensor-parallel ranks (Gated DeltaNet); Kimi Delta
# Attention's are not split yet.
TENSOR_PARALLEL_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")


def check_hybrid_support(config: EngineConfig, model: ModelConfig) -> None:
    """ValueError, one line naming the flag, for the first setting a hybrid model is not served with yet."""
    if not model.is_hybrid:
        return
    if config.tensor_parallel_size > 1 and model.architecture not in TENSOR_PARALLEL_ARCHITECTURES:
        raise ValueError(f"{flag('tensor_parallel_size')} is not supported with hybrid linear-attention models "
                         f"({model.architecture}) yet: the linear layers' heads are not split yet")
    for field, asked, why in _UNSUPPORTED:
        if asked(config):
            raise ValueError(f"{flag(field)} is not supported with hybrid linear-attention models "
                             f"({model.architecture}) yet: {why}")
