"""What single families are not served with yet (Step-3.7-Flash), checked at start (plain Python).

Step-3.7-Flash is checked on one rank and split tensor parallel; its per-head output gates, each layer kind's own
query head count and clamped SwiGLUs are not yet checked through the other splits or under adapters: such a setting is
refused at start in one line naming its flag rather than served wrongly.
"""

from engine.core.config import EngineConfig
from engine.core.hybrid_support import flag
from engine.core.model_config import ModelConfig

# architecture -> (EngineConfig field, is it asked for?, why not yet)
_UNSUPPORTED = {
    "Step3p7ForConditionalGeneration": (
        ("pipeline_parallel_size", lambda c: c.pipeline_parallel_size > 1, "its stages are not tested yet"),
        ("data_parallel_size", lambda c: c.data_parallel_size > 1,
         "replicas sharing experts are not tested with it yet"),
        ("enable_expert_parallel", lambda c: c.enable_expert_parallel, "expert parallelism is not tested with it yet"),
        ("enable_eplb", lambda c: c.enable_eplb, "expert parallelism is not tested with it yet"),
        ("enable_lora", lambda c: c.lora_enabled, "adapters are not tested with its gated attention yet"),
    ),
}


def check_family_support(config: EngineConfig, model: ModelConfig) -> None:
    """ValueError, one line naming the flag, for the first setting ``model``'s family is not served with yet."""
    for field, asked, why in _UNSUPPORTED.get(model.architecture, ()):
        if asked(config):
            raise ValueError(f"{flag(field)} is not supported with {model.architecture} yet: {why}")
