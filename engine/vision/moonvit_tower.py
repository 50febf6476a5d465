"""Kimi-K2.5's vision side: the MoonViT tower (14-pixel patch embedding, a learned position grid resampled
bicubically to each image, ViT blocks with 2-D axial rotary attention within each image, a final norm, each 2x2
window of patches gathered into one token) and the projector that maps a window to the text model's width.

Parameter names are the published checkpoint's below ``vision_tower.`` (``encoder.`` dropped) and ``mm_projector.``
(what transformers' ``save_pretrained`` writes too: it saves in that layout). Still images
only: a frame's temporal position embedding (row 0 of the table, zero) adds nothing, so it is not kept.
"""

import dataclasses

import torch
from torch import nn
from torch.nn import functional as F

from engine.vision.qwen3_vl_tower import ACTIVATIONS, VisionFeatures
from engine.vision.tower_rows import TowerState
from engine.vision.tower_rows import RowSplitTower


@dataclasses.dataclass(frozen=True)
class MoonViTConfig:
    """``vision_config`` of a Kimi-K2.5 checkpoint and the projector's settings, the fields the tower reads."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_layers: int
    out_hidden_size: int  # the text model's width
    patch_size: int = 14
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    merge_kernel_size: tuple[int, int] = (2, 2)
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    projection_hidden_size: int = 1152
    projection_eps: float = 1e-5

    @classmethod
    def from_hf(cls, whole) -> "MoonViTConfig":
        """From transformers' whole ``Kimi_K25Config`` (vision config, projector settings, text width)."""
        v = whole.vision_config
        if v.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision hidden_act {v.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})")
        rope = dict(getattr(v, "rope_parameters", None) or {})
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision rope_type {rope['rope_type']!r} is not supported (axial)")
        return cls(hidden_size=v.hidden_size, intermediate_size=v.intermediate_size, num_heads=v.num_attention_heads,
                   num_layers=v.num_hidden_layers, out_hidden_size=whole.text_config.hidden_size,
                   patch_size=v.patch_size, pos_emb_height=v.pos_emb_height, pos_emb_width=v.pos_emb_width,
                   merge_kernel_size=tuple(v.merge_kernel_size), hidden_act=v.hidden_act,
                   rope_theta=float(rope.get("rope_theta", 10000.0)),
                   projection_hidden_size=int(whole.projection_hidden_size or v.hidden_size),
                   projection_eps=float(whole.projection_layer_norm_eps))


def _bicubic_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Taps [n, 4] into a ``side``-long axis and their weights [n, 4] for target positions ``index`` on an axis of
    ``size``: ``F.interpolate(mode="bicubic", align_corners=False)`` (Keys kernel, a = -0.75, edges clamped)."""
    src = (index.to(torch.float32) + 0.5) * side / size - 0.5
    floor = torch.floor(src)
    offsets = torch.arange(-1, 3, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    d = (src[:, None] - floor[:, None] - offsets).abs()
    a = -0.75
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return taps, torch.where(d <= 1, near, far)


class PosEmbedding(nn.Module):
    def __init__(self, c: MoonViTConfig) -> None:
        super().__init__()
        self.c = c
        self.weight = nn.Parameter(torch.empty(c.pos_emb_height, c.pos_emb_width, c.hidden_size))

    def forward(self, grid_h: int, grid_w: int) -> torch.Tensor:
        """[grid_h * grid_w, D], row-major: the learned grid resampled bicubically to the image's grid."""
        side = self.c.pos_emb_height  # the reference indexes the table as square, rows of this length
        device = self.weight.device
        rows = torch.arange(grid_h, device=device).repeat_interleave(grid_w)
        cols = torch.arange(grid_w, device=device).repeat(grid_h)
        h_taps, h_w = _bicubic_taps(rows, grid_h, side)
        w_taps, w_w = _bicubic_taps(cols, grid_w, side)
        index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 16)
        weight = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 16)
        table = self.weight.flatten(0, 1)
        return F.embedding_bag(index, table, per_sample_weights=weight.to(table.dtype), mode="sum")


class PatchEmbed(nn.Module):
    def __init__(self, c: MoonViTConfig) -> None:
        super().__init__()
        self.c = c
        self.proj = nn.Conv2d(3, c.hidden_size, kernel_size=c.patch_size, stride=c.patch_size)
        self.pos_emb = PosEmbedding(c)

    def patches(self, pixels: torch.Tensor) -> torch.Tensor:
        # pixels [r, 3 * P * P] (one row per patch) -> [r, D], no positions
        p = self.c.patch_size
        return self.proj(pixels.to(self.proj.weight.dtype).view(-1, 3, p, p)).view(pixels.shape[0], -1)

    def forward(self, pixels: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        # pixels [L, 3 * P * P] (one row per patch, row-major) -> [L, D]
        x = self.patches(pixels)
        return x + self.pos_emb(grid_h, grid_w).to(x.dtype)


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [L, h, d] rotated in float32 by angle j on its pair (2j, 2j+1); cos, sin [L, 1, d/2]."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    return torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1).flatten(-2).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, c: MoonViTConfig) -> None:
        super().__init__()
        self.fc0 = nn.Linear(c.hidden_size, c.intermediate_size)
        self.fc1 = nn.Linear(c.intermediate_size, c.hidden_size)
        self.act = ACTIVATIONS[c.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(self.act(self.fc0(x)))


class Block(nn.Module):
    """One MoonViT block. Its attention is the checkpoint's fused ``wqkv`` and ``wo`` (held by the block, as
    published). The q and k rows keep MoonViT's own order (each rotary pair adjacent), so the rotary turns adjacent
    pairs; transformers permutes those rows to rotate halves instead, which gives the same scores."""

    def __init__(self, c: MoonViTConfig) -> None:
        super().__init__()
        self.num_heads = c.num_heads
        self.norm0 = nn.LayerNorm(c.hidden_size, eps=1e-5)
        self.norm1 = nn.LayerNorm(c.hidden_size, eps=1e-5)
        self.wqkv = nn.Linear(c.hidden_size, 3 * c.hidden_size)
        self.wo = nn.Linear(c.hidden_size, c.hidden_size)
        self.mlp = MLP(c)
        self.attention_width = c.hidden_size  # heads x head dim (``engine.vision.tower_rows``)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rows ``x`` [r, D] (of one image's patches; cos, sin [r, head_dim / 2] float32) -> their q, k, v
        [r, h, d], rotated (``engine.vision.tower_rows``)."""
        q, k, v = self.wqkv(self.norm0(x)).view(x.shape[0], 3, self.num_heads, -1).unbind(1)  # [r, h, d]
        cos, sin = cos[:, None, :], sin[:, None, :]
        return _rotate_pairs(q, cos, sin), _rotate_pairs(k, cos, sin), v

    def mix(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Rows ``x`` [r, D], their queries [r, h, d] against all the image's keys and values [L, h, d] -> [r, D]."""
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))  # [h, r, d]
        x = x + self.wo(out.transpose(0, 1).reshape(x.shape[0], -1))
        return x + self.mlp(self.norm1(x))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.mix(x, *self.project(x, cos, sin))


class MoonViT(RowSplitTower, nn.Module):
    """``forward(pixel_values [L, 3*P*P], grid_thw) -> [L / (kh*kw), kh*kw, D]``: one image's patch features,
    grouped by merge window (windows row-major, the window's patches row-major within it). Module names are the
    published checkpoint's (``vision_tower.encoder.blocks.N.wqkv``, ``norm0``, ``mlp.fc0``, ...) less
    ``encoder.``."""

    def __init__(self, c: MoonViTConfig) -> None:
        super().__init__()
        self.c = c
        self.patch_embed = PatchEmbed(c)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.num_layers))
        self.final_layernorm = nn.LayerNorm(c.hidden_size, eps=1e-5)

    def _rotary(self, grid_h: int, grid_w: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [L, head_dim / 2] float32: pair 2j turns by column x freq j, pair 2j+1 by row x freq j."""
        half = self.c.hidden_size // self.c.num_heads // 2
        # computed here, not kept as a buffer: a model built on the meta device has none to fill
        inv = 1.0 / (self.c.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
        rows = torch.arange(grid_h).repeat_interleave(grid_w).float()
        cols = torch.arange(grid_w).repeat(grid_h).float()
        angles = torch.stack([cols[:, None] * inv, rows[:, None] * inv], dim=-1).flatten(1).to(device)  # [L, half]
        return angles.cos(), angles.sin()

    def start(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> TowerState:
        """One image's state before the patch embedding: its pixels, positions and rotary angles."""
        t, grid_h, grid_w = grid_thw
        if t != 1:
            raise ValueError("only still images (grid t == 1) are supported")
        device = self.final_layernorm.weight.device
        pos = self.patch_embed.pos_emb(grid_h, grid_w).to(self.patch_embed.proj.weight.dtype)  # [L, D]
        cos, sin = self._rotary(grid_h, grid_w, device)
        return TowerState(pos.new_empty(pos.shape), cos, sin, grid_thw, pixels=pixel_values.to(device), pos=pos)

    def embed_rows(self, state: TowerState, a: int, b: int) -> None:
        state.x[a:b] = self.patch_embed.patches(state.pixels[a:b]) + state.pos[a:b]

    def finish(self, state: TowerState) -> torch.Tensor:
        """[L / (kh*kw), kh*kw, D] of an image whose state has run every block: normed, grouped by window."""
        _, grid_h, grid_w = state.grid_thw
        kh, kw = self.c.merge_kernel_size
        x = self.final_layernorm(state.x)
        d = x.shape[-1]
        # [gh/kh, kh, gw/kw, kw, D] -> [windows, kh*kw, D]: the reference's merge (a float32 gather, then its dtype)
        return x.view(grid_h // kh, kh, grid_w // kw, kw, d).permute(0, 2, 1, 3, 4).reshape(-1, kh * kw, d)

    def forward(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        state = self.start(pixel_values, grid_thw)
        self.embed_rows(state, 0, state.x.shape[0])
        self.run_blocks(state, 0, len(self.blocks))
        return self.finish(state)


class Projector(nn.Module):
    """``mm_projector``: each window's patches normalised, concatenated, then two linear layers (GELU between;
    the checkpoint's ``proj.0`` and ``proj.2``)."""

    def __init__(self, c: MoonViTConfig) -> None:
        super().__init__()
        width = c.hidden_size * c.merge_kernel_size[0] * c.merge_kernel_size[1]
        self.width = width
        self.pre_norm = nn.LayerNorm(c.projection_hidden_size, eps=c.projection_eps)
        self.proj = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, c.out_hidden_size))

    def forward(self, windows: torch.Tensor) -> torch.Tensor:
        # windows [N, kh*kw, D] -> [N, text hidden]
        return self.proj(self.pre_norm(windows).view(windows.shape[0], self.width))


def projected(projector: Projector, windows: torch.Tensor) -> VisionFeatures:
    """The features of an image's windows [N, kh*kw, D] (the tower's output): projected, no deepstack taps (an
    empty [0, N, H])."""
    embeds = projector(windows)
    return VisionFeatures(embeds, embeds.new_zeros(0, *embeds.shape))
