"""GLM-5: DeepSeek-V3.2's sparse attention (``engine.models.deepseek_v32``) with interleaved rope in the indexer,
and layers that ``indexer_types`` marks "shared": they have no indexer and attend to the tokens the last "full"
layer selected. The next-token-prediction layer after the last one is not loaded (``MoECausalLM.extra_layer``)."""

from engine.core.model_config import CheckpointError
from engine.models.deepseek_v32 import DeepseekV32ForCausalLM


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    index_rope_interleave = True

    def indexed(self, layer_idx: int) -> bool:
        kinds = self.config.cfg("indexer_types") or ["full"] * self.config.num_layers
        if kinds[0] != "full":
            raise CheckpointError("indexer_types must start with a \"full\" layer: a \"shared\" layer reuses the "
                                  "selection of the last full layer before it")
        return kinds[layer_idx] == "full"
