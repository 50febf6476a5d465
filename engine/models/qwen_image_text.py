"""What the Qwen image-text families share (Qwen3-VL-MoE, Qwen3.5-MoE): Qwen's ViT tower
(``engine.vision.qwen3_vl_tower``), whose merged features replace the image placeholder tokens' embeddings and,
where the checkpoint taps some blocks (Qwen3-VL's deepstack), are added to those tokens' hidden states after the
first text layers; and M-RoPE positions from each request's prompt layout (``engine.vision.mrope``).

A step's image work is prepared by ``image_step`` (the runner calls it with the step's parts and puts the result
in the batch's metadata, ``meta.images``), each image encoded once per request (``engine.models.image_features``);
under tensor parallelism on rank 0, which hands the step to the other ranks (``engine.models.image_step``): the text
layers split as the text family's, every rank with the same positions, image rows and deepstack features.
"""

import torch
from torch import nn

from engine.core.model_config import ModelConfig
from engine.core.request import Request
from engine.core.scheduler import ScheduledRequest
from engine.device_batch.attention_metadata import AttentionMetadata
from engine.distributed.collectives import SINGLE, TensorParallel
from engine.distributed.pipeline import WHOLE, PipelineStage
from engine.models.image_features import ImageFeatures
from engine.models.image_step import ImageStep, image_step_of
from engine.vision.mrope import ImageSpan, prompt_positions
from engine.vision.mrope_rotary import MRotaryEmbedding
from engine.vision.qwen_image_processing import ProcessedImage
from engine.vision.qwen3_vl_tower import Qwen3VisionTower, VisionConfig, VisionFeatures
from engine.vision.tower_rows import TowerState


class QwenImageText(ImageFeatures):
    """Mixed in before a text family (``class X(QwenImageText, TextFamily)``): the tower under ``visual.``
    (the checkpoint's ``model.visual.``), M-RoPE over the text layers, and the image steps."""

    rotary_class = MRotaryEmbedding
    takes_images = True
    tower_names = ("visual.",)
    step_positions = True

    def __init__(self, config: ModelConfig, moe_backend: str, max_positions: int, tp: TensorParallel = SINGLE,
                 stage: PipelineStage = WHOLE) -> None:
        self.check_image_split(config.architecture, tp, stage)
        super().__init__(config, moe_backend, max_positions, tp, stage)
        whole = config.multimodal_config
        # rank 0's alone: the other ranks receive each step's features (engine.models.image_step)
        vision = VisionConfig.from_hf(whole.vision_config)
        self._encoder_shape = (1 + vision.depth, vision.spatial_merge_size ** 2)
        self.visual = Qwen3VisionTower(vision) if self.holds_tower else None
        self.image_token_id = int(whole.image_token_id)
        self.init_image_features()
        self._layout: dict[str, tuple[torch.Tensor, int]] = {}  # request id -> (prompt positions [3, L], delta)

    # ---- per request ------------------------------------------------------------------------
    def _prompt_layout(self, request: Request) -> tuple[torch.Tensor, int]:
        if request.request_id not in self._layout:
            spans = [ImageSpan(im.offset, im.rows, im.cols) for im in request.images]
            self._layout[request.request_id] = prompt_positions(request.num_prompt_tokens, spans)
        return self._layout[request.request_id]

    @property
    def encoder_shape(self) -> tuple[int, int]:
        return self._encoder_shape

    @property
    def tower_block(self) -> nn.Module:
        return self.visual.blocks[0]

    def encode(self, pixels: ProcessedImage) -> VisionFeatures:
        return self.visual(pixels.pixel_values, pixels.grid_thw)

    def begin_encoding(self, pixels: ProcessedImage) -> TowerState:
        return self.visual.start(pixels.pixel_values, pixels.grid_thw)

    def encode_passes(self, state: TowerState, first: int, end: int) -> None:
        self.visual.run_passes(state, first, end)

    def finish_encoding(self, state: TowerState) -> VisionFeatures:
        return self.visual.finish(state)

    def forget_images(self, request_ids) -> None:
        """Drop the features and layouts kept for requests that finished."""
        super().forget_images(request_ids)
        for rid in request_ids:
            self._layout.pop(rid, None)

    # ---- per step ---------------------------------------------------------------------------
    def local_image_step(self, scheduled: list[ScheduledRequest], ranges: tuple[tuple[int, int], ...],
                         num_rows: int, device: torch.device) -> ImageStep:
        """A forward's positions and image rows from the step's parts (``ranges``: their flat rows, in the same
        order)."""
        positions = torch.zeros(3, num_rows, dtype=torch.int64)
        rows, embeds, deepstack = [], [], []
        for part, (a, b) in zip(scheduled, ranges):
            index = torch.arange(part.start, part.start + (b - a))  # [n] the part's token indices
            request = part.request
            if not request.images:
                positions[:, a:b] = index
                continue
            layout, delta = self._prompt_layout(request)
            in_prompt = index < layout.shape[1]
            positions[:, a:b] = torch.where(in_prompt, layout[:, index.clamp(max=layout.shape[1] - 1)], index + delta)
            for image_rows, feats, taken in self.image_rows(part, a, b):
                rows.append(image_rows)
                embeds.append(feats.embeds[taken])
                deepstack.append(feats.deepstack[:, taken])
        return image_step_of(positions, rows, embeds, deepstack, self.config.hidden_size,
                             self.model.embed_tokens.weight.dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        step: ImageStep | None = meta.images
        x = self.model.embed_tokens(input_ids)  # [T, H]
        if step is not None:
            positions = step.positions  # [3, T]
            if step.rows.numel():
                x = x.index_copy(0, step.rows, step.embeds.to(x.dtype))
        residual = None
        for i, layer in enumerate(self.local_layers()):
            x, residual = layer(x, residual, positions, meta)
            if step is not None and step.rows.numel() and i < step.deepstack.shape[0]:
                # the residual sum finished first, then the features added: the reference's order of additions
                x, residual = x + residual, None
                x = x.index_add(0, step.rows, step.deepstack[i].to(x.dtype))
        return self.final_norm(x, residual)
