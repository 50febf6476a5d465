"""Qwen3-VL's vision tower, Qwen3.5's too: patch embedding, a learned position grid resampled to each image, ViT
blocks with 2-D rotary attention within each image, the 2x2 patch merger, and the deepstack taps (merged features
of a few early blocks, which the text model adds to the image tokens' hidden states in its first layers; Qwen3.5
has none).

Parameter names are the checkpoint's below ``model.visual.`` (the text model loads the rest).
"""

import dataclasses

import torch
from torch import nn
from torch.nn import functional as F

from engine.vision.tower_rows import RowSplitTower, TowerState

ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
}


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """``vision_config`` of a Qwen3-VL or Qwen3.5 checkpoint, the fields the tower reads."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, hf) -> "VisionConfig":
        """From transformers' vision config object."""
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        if hf.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision hidden_act {hf.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})")
        return cls(depth=hf.depth, hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
                   num_heads=hf.num_heads, out_hidden_size=hf.out_hidden_size, patch_size=hf.patch_size,
                   temporal_patch_size=hf.temporal_patch_size, spatial_merge_size=hf.spatial_merge_size,
                   in_channels=hf.in_channels, num_position_embeddings=hf.num_position_embeddings,
                   # Qwen3.5's tower taps no blocks (its config has no deepstack_visual_indexes)
                   deepstack_visual_indexes=tuple(getattr(hf, "deepstack_visual_indexes", None) or ()),
                   hidden_act=hf.hidden_act,
                   rope_theta=float(rope.get("rope_theta", 10000.0)))


@dataclasses.dataclass(frozen=True)
class VisionFeatures:
    """One image's features, one row per placeholder token."""

    embeds: torch.Tensor  # [N, out_hidden] the merger's output, which replaces the placeholders' embeddings
    deepstack: torch.Tensor  # [K, N, out_hidden] added to the hidden states after text layers 0..K-1


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class PatchEmbed(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.c = c
        kernel = (c.temporal_patch_size, c.patch_size, c.patch_size)
        self.proj = nn.Conv3d(c.in_channels, c.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # pixels [L, C * T * P * P] -> [L, hidden]: each row is one patch, so the conv is one matmul per patch
        c = self.c
        x = pixels.to(self.proj.weight.dtype).view(-1, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        return self.proj(x).view(-1, c.hidden_size)


class VisionAttention(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.num_heads = c.num_heads
        self.qkv = nn.Linear(c.hidden_size, 3 * c.hidden_size, bias=True)
        self.proj = nn.Linear(c.hidden_size, c.hidden_size, bias=True)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # x [r, D] (rows of one image's patches); cos, sin [r, head_dim] float32 -> q, k, v [r, h, d], rotated
        q, k, v = self.qkv(x).reshape(x.shape[0], 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        cos, sin = cos[:, None, :], sin[:, None, :]
        # rotary in float32, as the checkpoint was trained
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [r, h, d] (some query rows), k, v [L, h, d] (all the image's) -> [r, D]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))  # [h, r, d]
        return self.proj(out.transpose(0, 1).reshape(q.shape[0], -1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [L, D] (one image's patches); cos, sin [L, head_dim] float32
        return self.attend(*self.project(x, cos, sin))


class VisionMLP(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(c.hidden_size, c.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(c.intermediate_size, c.hidden_size, bias=True)
        self.act = ACTIVATIONS[c.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(c.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(c.hidden_size, eps=1e-6)
        self.attn = VisionAttention(c)
        self.mlp = VisionMLP(c)
        self.attention_width = c.hidden_size  # heads x head dim (``engine.vision.tower_rows``)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rows ``x`` [r, D] -> their q, k, v [r, h, d] (``engine.vision.tower_rows``)."""
        return self.attn.project(self.norm1(x), cos, sin)

    def mix(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Rows ``x`` [r, D], their queries [r, h, d] against all the image's keys and values [L, h, d] -> [r, D]."""
        x = x + self.attn.attend(q, k, v)
        return x + self.mlp(self.norm2(x))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.mix(x, *self.project(x, cos, sin))


class PatchMerger(nn.Module):
    """Each 2x2 window of patches (consecutive rows) -> one token of the text model's width. The deepstack mergers
    normalize the concatenated window (``postshuffle``), the final one each patch before concatenating."""

    def __init__(self, c: VisionConfig, postshuffle: bool) -> None:
        super().__init__()
        self.width = c.hidden_size * c.spatial_merge_size ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else c.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, c.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [L, D] -> [L / m^2, out_hidden]
        x = self.norm(x.view(-1, self.width)) if self.postshuffle else self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def block_order_coords(grid_h: int, grid_w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) [h*w] of each patch in the processor's order: merge windows row-major, patches within each."""
    rows = torch.arange(grid_h).view(grid_h // merge, merge, 1, 1).expand(-1, -1, grid_w // merge, merge)
    cols = torch.arange(grid_w).view(1, 1, grid_w // merge, merge).expand(grid_h // merge, merge, -1, -1)
    return rows.transpose(1, 2).reshape(-1), cols.transpose(1, 2).reshape(-1)


class Qwen3VisionTower(RowSplitTower, nn.Module):
    """``forward(pixel_values [L, C*T*P*P], grid_thw) -> VisionFeatures`` for one image (t == 1)."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.c = c
        self.patch_embed = PatchEmbed(c)
        self.pos_embed = nn.Embedding(c.num_position_embeddings, c.hidden_size)
        self.side = int(c.num_position_embeddings ** 0.5)
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c.depth))
        self.merger = PatchMerger(c, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(c, postshuffle=True) for _ in c.deepstack_visual_indexes)

    def _position_embedding(self, rows: torch.Tensor, cols: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        """[L, D]: the learned square grid, bilinearly resampled (corners aligned) to the image's grid."""
        def taps(index: torch.Tensor, size: int):
            src = index.float() * (self.side - 1) / max(size - 1, 1)
            floor = torch.floor(src)
            lo = floor.long().clamp(0, self.side - 1)
            hi = (floor.long() + 1).clamp(0, self.side - 1)
            frac = src - floor
            return (lo, hi), (1 - frac, frac)

        (r0, r1), (wr0, wr1) = taps(rows, grid_h)
        (c0, c1), (wc0, wc1) = taps(cols, grid_w)
        weight = self.pos_embed.weight
        out = 0
        for r, wr in ((r0, wr0), (r1, wr1)):
            for c, wc in ((c0, wc0), (c1, wc1)):
                out = out + weight[r * self.side + c] * (wr * wc)[:, None].to(weight.dtype)
        return out

    def _rotary(self, rows: torch.Tensor, cols: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [L, head_dim] float32: the row angles then the column angles, the pair twice (rotate-half)."""
        half = self.c.hidden_size // self.c.num_heads // 2  # each axis rotates half of the head
        # computed here, not kept as a buffer: a model built on the meta device has none to fill
        inv = (1.0 / (self.c.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))).to(device)
        freqs = torch.cat([rows.to(device).float()[:, None] * inv, cols.to(device).float()[:, None] * inv], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def start(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> TowerState:
        """One image's state before the patch embedding: its pixels, positions and rotary angles."""
        t, grid_h, grid_w = grid_thw
        if t != 1:
            raise ValueError("only still images (grid t == 1) are supported")
        rows, cols = block_order_coords(grid_h, grid_w, self.c.spatial_merge_size)
        device = self.pos_embed.weight.device
        rows, cols = rows.to(device), cols.to(device)
        pos = self._position_embedding(rows, cols, grid_h, grid_w).to(self.patch_embed.proj.weight.dtype)  # [L, D]
        cos, sin = self._rotary(rows, cols, device)
        x = pos.new_empty(pos.shape)  # [L, D], filled by embed_rows
        return TowerState(x, cos, sin, grid_thw, pixels=pixel_values.to(device), pos=pos)

    def embed_rows(self, state: TowerState, a: int, b: int) -> None:
        state.x[a:b] = self.patch_embed(state.pixels[a:b]) + state.pos[a:b]

    def _mergers_after(self, i: int) -> list[PatchMerger]:
        """The mergers that read block ``i``'s output: its deepstack tap's, then the final one after the last."""
        taps = self.c.deepstack_visual_indexes
        return ([self.deepstack_merger_list[taps.index(i)]] if i in taps else []) + (
            [self.merger] if i == len(self.blocks) - 1 else [])

    def after_rows(self, state: TowerState, i: int, b: int) -> None:
        """Block ``i``'s mergers over the merge windows whose rows (of ``0:b``) it has mixed, as they are mixed:
        so their work spreads over the block's pieces (each window's output is its own rows')."""
        mergers = self._mergers_after(i)
        m2 = self.c.spatial_merge_size ** 2
        w0, w1 = state.merged, b // m2
        if not mergers or w1 <= w0:
            return
        rows = state.x[w0 * m2:w1 * m2]  # [windows * m^2, D]
        if state.merged_out is None:
            state.merged_out = [None] * len(mergers)
        for j, merger in enumerate(mergers):
            out = merger(rows)  # [windows, width]
            if state.merged_out[j] is None:
                state.merged_out[j] = out.new_empty(state.x.shape[0] // m2, out.shape[-1])
            state.merged_out[j][w0:w1] = out
        state.merged = w1

    def after_block(self, state: TowerState, i: int) -> None:
        """Block ``i``'s mergers: its deepstack tap, the final merger after the last block (taken row by row as
        the rows were mixed, else now)."""
        outs = state.merged_out or [merger(state.x) for merger in self._mergers_after(i)]
        state.merged, state.merged_out = 0, None
        if i in self.c.deepstack_visual_indexes:
            state.taps.append(outs[0])
        if i == len(self.blocks) - 1:
            state.final = outs[-1]

    def finish(self, state: TowerState) -> VisionFeatures:
        """The features of an image whose state has run every block: the merger's, and the taps stacked."""
        embeds = state.final
        deepstack = torch.stack(state.taps) if state.taps else embeds.new_zeros(0, *embeds.shape)
        return VisionFeatures(embeds, deepstack)

    def forward(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> VisionFeatures:
        state = self.start(pixel_values, grid_thw)
        self.embed_rows(state, 0, state.x.shape[0])
        self.run_blocks(state, 0, len(self.blocks))
        return self.finish(state)
