"""What DeepSeek-V4 (``DeepseekV4ForCausalLM``) is served with, checked at start (plain Python).

Its layers cache per token a key row and, for the compressed layers, the compressor's (and indexer's) raw
projections, from which every step recomputes the compressed entries (``engine.layers.compressed_attention``):
the prefix cache, chunked prefill and preemption handle those rows as any KV row. Settings not yet built or tested
with it are refused at start, in one line naming the flag, rather than served wrongly.
"""

from engine.core.config import EngineConfig
from engine.core.hybrid_support import flag
from engine.core.model_config import ModelConfig

V4_ARCHITECTURES = ("DeepseekV4ForCausalLM",)

# (EngineConfig field, is it asked for?, why not yet)
_UNSUPPORTED = (
    ("tensor_parallel_size", lambda c: c.tensor_parallel_size > 1, "its attention and experts are not split yet"),
    ("pipeline_parallel_size", lambda c: c.pipeline_parallel_size > 1,
     "the hyper-connection streams are not handed across stages yet"),
    ("data_parallel_size", lambda c: c.data_parallel_size > 1, "replicas sharing experts are not built for it yet"),
    ("enable_expert_parallel", lambda c: c.enable_expert_parallel, "expert parallelism is not built for it yet"),
    ("enable_eplb", lambda c: c.enable_eplb, "expert parallelism is not built for it yet"),
    ("quantization", lambda c: c.quantization is not None, "its clamped experts run unquantized (a torch loop)"),
    ("speculative", lambda c: c.speculative is not None, "speculative decoding is not tested with it yet"),
    ("role", lambda c: c.role != "both", "a KV handoff of the compressor rows is not tested yet"),
    ("host_cache_gb", lambda c: c.host_cache_gb > 0, "the prefix-cache tiers are not tested with its rows yet"),
    ("disk_cache_dir", lambda c: c.disk_cache_dir is not None,
     "the prefix-cache tiers are not tested with its rows yet"),
    ("enable_lora", lambda c: c.lora_enabled, "adapters are not applied to its attention or experts yet"),
)


def check_deepseek_v4_support(config: EngineConfig, model: ModelConfig) -> None:
    """ValueError, one line naming the flag, for the first setting DeepSeek-V4 is not served with yet."""
    if model.architecture not in V4_ARCHITECTURES:
        return
    for field, asked, why in _UNSUPPORTED:
        if asked(config):
            raise ValueError(f"{flag(field)} is not supported with DeepSeek-V4 ({model.architecture}) yet: {why}")
