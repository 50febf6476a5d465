"""Rotary embedding over M-RoPE position triples: the model's cos/sin tables read at each frequency's own part."""

import torch

from engine.core.model_config import ModelConfig
from engine.layers.rotary import RotaryEmbedding
from engine.vision.mrope import section_index


class MRotaryEmbedding(RotaryEmbedding):
    """``forward(positions, q, k)`` with positions [3, T] (t, h, w), or [T] where all three are equal (text). The
    sections (``mrope_section``) split the rotated dims' frequencies, all of each head's or the first
    ``partial_rotary_factor`` of it."""

    # Qwen3-VL interleaves the parts whatever its config says (transformers reads no flag for it).
    interleaved = True
    fusable = False  # three positions per token: the fused kernel reads one

    def __init__(self, config: ModelConfig, head_dim: int, max_positions: int) -> None:
        sections = tuple(config.rope_parameters.get("mrope_section") or ())
        if len(sections) != 3:
            raise ValueError(f"mrope_section {list(sections)} must name three parts (t, h, w)")
        super().__init__(config, head_dim, max_positions)
        self.register_buffer("part", self._part(), persistent=False)  # [r]

    def _part(self) -> torch.Tensor:
        """[r] int64: the part (0 t, 1 h, 2 w) each rotated dimension reads its position from."""
        sections = tuple(self.config.rope_parameters["mrope_section"])
        index = section_index(self.rotary_dim // 2, sections, self.interleaved)
        return torch.cat([index, index])

    @torch.no_grad()
    def build_cache(self) -> None:
        """The cos/sin tables and the part of each dimension (again after a build on the meta device)."""
        super().build_cache()
        if "part" in self._buffers:
            self.part = self._part().to(self.cos_cache.device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        # positions [3, T]: each dimension's table row read at its part's position, then the plain rotation
        part = self.part[None, None, :].expand(1, positions.shape[1], -1)  # [1, T, r]
        cos = self.cos_cache[positions].gather(0, part)[0].to(q.dtype)[:, None, :]  # [T, 1, r]
        sin = self.sin_cache[positions].gather(0, part)[0].to(q.dtype)[:, None, :]
        # partial rotary (Qwen3.5: a quarter of each head): the sections cover the rotated dims only
        return self.rotate(q, k, cos, sin)
