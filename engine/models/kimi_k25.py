"""Kimi-K2.5 (``Kimi_K25ForConditionalGeneration``) with images: the DeepSeek-V3 text model (MLA, grouped sigmoid
routing) with the MoonViT tower's projected features in place of the image placeholder tokens' embeddings.

Positions stay one per token (no multi-part rotary), so the text path is DeepSeek-V3's unchanged; only the
embeddings of the image rows differ. A step's image rows are prepared by ``image_step`` (the runner calls it and
puts the result in the batch's metadata, ``meta.images``), each image encoded once per request
(``engine.models.image_features``); under tensor parallelism on rank 0, which hands the step's image rows to the
other ranks (``engine.models.image_step``), the text model split as DeepSeek-V3's.
"""

import torch
from torch import nn

from engine.core.model_config import ModelConfig
from engine.core.scheduler import ScheduledRequest
from engine.device_batch.attention_metadata import AttentionMetadata
from engine.distributed.collectives import SINGLE, TensorParallel
from engine.distributed.pipeline import WHOLE, PipelineStage
from engine.models.base import WeightRule
from engine.models.deepseek import DeepseekV3ForCausalLM
from engine.models.deepseek_moe import DEEPSEEK_MOE_ALIASES
from engine.models.image_features import ImageFeatures
from engine.models.image_step import ImageStep, image_step_of
from engine.vision.moonvit_tower import MoonViT, MoonViTConfig, Projector, projected
from engine.vision.qwen_image_processing import ProcessedImage
from engine.vision.qwen3_vl_tower import VisionFeatures
from engine.vision.tower_rows import TowerState


class Kimi_K25ForConditionalGeneration(ImageFeatures, DeepseekV3ForCausalLM):
    takes_images = True
    tower_names = ("vision_tower.", "mm_projector.")
    # The published layout: the language model under language_model., the tower's blocks under
    # vision_tower.encoder.; then DeepSeek's renames. transformers' save_pretrained writes that layout with a few
    # names of its own (the text layers as language_model.model.blocks., the projector's norm under model.,
    # the patch embedding under vision_tower.encoder.): both are read.
    name_aliases = (("language_model.model.blocks.", "model.layers."), ("language_model.model.", "model."),
                    ("language_model.lm_head.", "lm_head."), ("model.mm_projector.", "mm_projector."),
                    ("vision_tower.encoder.", "vision_tower."), *DEEPSEEK_MOE_ALIASES)
    # the tower's and projector's names are their own (none of the text model's packing rules)
    weight_rules = (WeightRule(r"^((?:vision_tower|mm_projector)\..*)$", r"\1"), *DeepseekV3ForCausalLM.weight_rules)

    def __init__(self, config: ModelConfig, moe_backend: str, max_positions: int, tp: TensorParallel = SINGLE,
                 stage: PipelineStage = WHOLE) -> None:
        self.check_image_split(config.architecture, tp, stage)
        super().__init__(config, moe_backend, max_positions, tp, stage)
        whole = config.multimodal_config
        vision = MoonViTConfig.from_hf(whole)
        self._encoder_shape = (1 + vision.num_layers, vision.merge_kernel_size[0] * vision.merge_kernel_size[1])
        # rank 0's alone: the other ranks receive each step's features (engine.models.image_step)
        self.vision_tower = MoonViT(vision) if self.holds_tower else None
        self.mm_projector = Projector(vision) if self.holds_tower else None
        self.image_token_id = int(whole.image_token_id)
        self.init_image_features()

    @property
    def encoder_shape(self) -> tuple[int, int]:
        return self._encoder_shape

    @property
    def tower_block(self) -> nn.Module:
        return self.vision_tower.blocks[0]

    def encode(self, pixels: ProcessedImage) -> VisionFeatures:
        return projected(self.mm_projector, self.vision_tower(pixels.pixel_values, pixels.grid_thw))

    def begin_encoding(self, pixels: ProcessedImage) -> TowerState:
        return self.vision_tower.start(pixels.pixel_values, pixels.grid_thw)

    def encode_passes(self, state: TowerState, first: int, end: int) -> None:
        self.vision_tower.run_passes(state, first, end)

    def finish_encoding(self, state: TowerState) -> VisionFeatures:
        return projected(self.mm_projector, self.vision_tower.finish(state))

    # ---- per step ---------------------------------------------------------------------------
    def local_image_step(self, scheduled: list[ScheduledRequest], ranges: tuple[tuple[int, int], ...],
                         num_rows: int, device: torch.device) -> ImageStep:
        """A forward's image rows and features from the step's parts (``ranges``: their flat rows, in order)."""
        rows, embeds = [], []
        for part, (a, b) in zip(scheduled, ranges):
            for image_rows, feats, taken in self.image_rows(part, a, b):
                rows.append(image_rows)
                embeds.append(feats.embeds[taken])
        return image_step_of(None, rows, embeds, [], self.config.hidden_size, self.model.embed_tokens.weight.dtype,
                             device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        step: ImageStep | None = meta.images
        if step is not None and step.rows.numel():
            # the placeholder id may lie past the vocabulary: those rows embed token 0, then take the features
            x = self.model.embed_tokens(input_ids.index_fill(0, step.rows, 0))
            x = x.index_copy(0, step.rows, step.embeds.to(x.dtype))
        else:
            x = self.model.embed_tokens(input_ids)
        x, residual = self.run_layers(x, None, positions, meta)
        return self.final_norm(x, residual)
