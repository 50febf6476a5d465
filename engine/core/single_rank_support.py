"""Families served on one rank only for now (Step-3.7-Flash), checked at start (plain Python).

Their layers hold what the split paths do not cut yet (Step-3.7-Flash: the per-head output gate ``g_proj``, each
layer kind's own query head count, clamped SwiGLUs); a setting that would split them, or apply adapters, is refused
at start in one line naming its flag rather than served wrongly.
"""

from engine.core.config import EngineConfig
from engine.core.hybrid_support import flag
from engine.core.model_config import ModelConfig

SINGLE_RANK_ARCHITECTURES = ("Step3p7ForConditionalGeneration",)

# (EngineConfig field, is it asked for?, why not yet)
_UNSUPPORTED = (
    ("tensor_parallel_size", lambda c: c.tensor_parallel_size > 1, "the per-head output gate is not split yet"),
    ("pipeline_parallel_size", lambda c: c.pipeline_parallel_size > 1, "its stages are not tested yet"),
    ("data_parallel_size", lambda c: c.data_parallel_size > 1, "replicas sharing experts are not tested with it yet"),
    ("enable_expert_parallel", lambda c: c.enable_expert_parallel, "expert parallelism is not tested with it yet"),
    ("enable_eplb", lambda c: c.enable_eplb, "expert parallelism is not tested with it yet"),
    ("enable_lora", lambda c: c.lora_enabled, "adapters are not tested with its gated attention yet"),
)


def check_single_rank_support(config: EngineConfig, model: ModelConfig) -> None:
    """ValueError, one line naming the flag, for the first setting a one-rank family is not served with yet."""
    if model.architecture not in SINGLE_RANK_ARCHITECTURES:
        return
    for field, asked, why in _UNSUPPORTED:
        if asked(config):
            raise ValueError(f"{flag(field)} is not supported with {model.architecture} yet: {why}")
