"""What sparse-attention models (DeepSeek-V3.2, GLM-5, MiniMax-M3) are served with, checked at start (plain Python).

Their layers cache an indexer key per token beside the MLA latent (MiniMax-M3's beside K and V), and GLM-5's layers
hand their selection to the next. Settings not yet tested with them are refused at start, in one line naming the
flag, rather than served wrongly. The prefix cache, chunked prefill, preemption and n-gram speculation are served
(the indexer keys live in the same paged blocks as the latents, or as K and V).
"""

from engine.core.config import EngineConfig
from engine.core.hybrid_support import flag
from engine.core.model_config import ModelConfig

SPARSE_ATTENTION_ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM",
                                  "MiniMaxM3SparseForConditionalGeneration")

# (EngineConfig field, is it asked for?, why not yet)
_UNSUPPORTED = (
    ("tensor_parallel_size", lambda c: c.tensor_parallel_size > 1, "the indexer is not split over ranks yet"),
    ("pipeline_parallel_size", lambda c: c.pipeline_parallel_size > 1,
     "a layer's selection is not handed across stages yet"),
    ("data_parallel_size", lambda c: c.data_parallel_size > 1, "replicas sharing experts are not tested with them yet"),
    ("enable_expert_parallel", lambda c: c.enable_expert_parallel, "expert parallelism is not tested with them yet"),
    ("enable_eplb", lambda c: c.enable_eplb, "expert parallelism is not tested with them yet"),
    ("speculative", lambda c: c.speculative not in (None, "ngram"), "only n-gram drafts are tested with them yet"),
    ("role", lambda c: c.role != "both", "a KV handoff of the indexer keys is not tested yet"),
    ("host_cache_gb", lambda c: c.host_cache_gb > 0, "the prefix-cache tiers are not tested with the indexer keys yet"),
    ("disk_cache_dir", lambda c: c.disk_cache_dir is not None,
     "the prefix-cache tiers are not tested with the indexer keys yet"),
    ("enable_lora", lambda c: c.lora_enabled, "adapters are not applied to sparse attention yet"),
)


def check_sparse_attention_support(config: EngineConfig, model: ModelConfig) -> None:
    """ValueError, one line naming the flag, for the first setting a sparse-attention model is not served with yet."""
    if model.architecture not in SPARSE_ATTENTION_ARCHITECTURES:
        return
    for field, asked, why in _UNSUPPORTED:
        if asked(config):
            raise ValueError(f"{flag(field)} is not supported with sparse-attention models ({model.architecture}) "
                             f"yet: {why}")
