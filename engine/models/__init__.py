"""Model families, keyed by the `architectures` entry of config.json."""

from engine.core.model_config import ModelConfig
from engine.models.base import MoECausalLM
from engine.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from engine.models.deepseek_v32 import DeepseekV32ForCausalLM
from engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from engine.models.dots1 import Dots1ForCausalLM
from engine.models.glm4_moe import Glm4MoeForCausalLM
from engine.models.glm_moe_dsa import GlmMoeDsaForCausalLM
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.hy_v3 import HYV3ForCausalLM
from engine.models.kimi_k25 import Kimi_K25ForConditionalGeneration
from engine.models.kimi_linear import KimiLinearForCausalLM
from engine.models.mimo_v2_flash import MiMoV2FlashForCausalLM
from engine.models.minimax_m2 import MiniMaxM2ForCausalLM
from engine.models.minimax_m3 import MiniMaxM3SparseForConditionalGeneration
from engine.models.mixtral import MixtralForCausalLM
from engine.models.olmoe import OlmoeForCausalLM
from engine.models.qwen2_moe import Qwen2MoeForCausalLM
from engine.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeWithImages
from engine.models.qwen3_moe import Qwen3MoeForCausalLM
from engine.models.qwen3_next import Qwen3NextForCausalLM
from engine.models.qwen3_vl_moe import Qwen3VLMoeForConditionalGeneration
from engine.models.step3p7 import Step3p7ForConditionalGeneration

MODEL_REGISTRY: dict[str, type[MoECausalLM]] = {
    cls.__name__: cls
    for cls in (MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, OlmoeForCausalLM, Glm4MoeForCausalLM,
                Dots1ForCausalLM, MiniMaxM2ForCausalLM, GptOssForCausalLM, DeepseekV2ForCausalLM, DeepseekV3ForCausalLM,
                Qwen3NextForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration, MiMoV2FlashForCausalLM,
                HYV3ForCausalLM, KimiLinearForCausalLM, DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM,
                Qwen3VLMoeForConditionalGeneration, Step3p7ForConditionalGeneration,
                MiniMaxM3SparseForConditionalGeneration, DeepseekV4ForCausalLM, Kimi_K25ForConditionalGeneration)
}
# Kimi-K2.5's published checkpoints name it as its remote code did; transformers' class is the same model.
MODEL_REGISTRY["KimiK25ForConditionalGeneration"] = Kimi_K25ForConditionalGeneration
# Architectures served as text or with images by the same name: the class for a checkpoint with a vision config.
WITH_IMAGES: dict[str, type[MoECausalLM]] = {"Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeWithImages}


def model_class(config: ModelConfig) -> type[MoECausalLM]:
    """The family class that serves ``config``: by its architecture, with images where it has a vision config
    (``ModelConfig.multimodal_config``)."""
    if config.multimodal_config is not None and config.architecture in WITH_IMAGES:
        return WITH_IMAGES[config.architecture]
    return MODEL_REGISTRY[config.architecture]


__all__ = ["MODEL_REGISTRY", "MoECausalLM", "model_class"]
