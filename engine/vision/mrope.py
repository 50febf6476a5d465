"""Qwen-VL's multimodal rotary positions (M-RoPE): each token has a (temporal, height, width) position triple.

Text tokens take their running index in all three; an image's placeholder tokens take the index where the image
starts, plus their merge window's row (height) and column (width), and the text after the image resumes at the
start plus the larger of the image's two sides (in merge windows). Positions therefore run behind the token
index: a request's ``delta`` (its last position + 1 minus its length) shifts every token decoded after the
prompt, all three parts equal.
"""

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class ImageSpan:
    """Where one image's placeholder tokens sit in the prompt, and their grid (in merged tokens)."""

    offset: int  # index of the first placeholder token in the prompt
    rows: int  # merge windows down (grid_h / merge)
    cols: int  # merge windows across (grid_w / merge)

    @property
    def length(self) -> int:
        return self.rows * self.cols


def prompt_positions(prompt_len: int, spans: list[ImageSpan]) -> tuple[torch.Tensor, int]:
    """-> (positions [3, prompt_len] int64, delta): the prompt's M-RoPE positions, and what every later token's
    index is shifted by. ``spans`` in prompt order, within the prompt, not overlapping."""
    parts = []
    cursor = 0  # next prompt index
    pos = 0  # next position
    for span in spans:
        text = span.offset - cursor
        parts.append(torch.arange(pos, pos + text).expand(3, -1))
        pos += text
        rows = torch.arange(span.rows).repeat_interleave(span.cols)
        cols = torch.arange(span.cols).repeat(span.rows)
        parts.append(torch.stack([torch.zeros(span.length, dtype=torch.int64), rows, cols]) + pos)
        pos += max(span.rows, span.cols)
        cursor = span.offset + span.length
    parts.append(torch.arange(pos, pos + prompt_len - cursor).expand(3, -1))
    pos += prompt_len - cursor
    return torch.cat(parts, dim=1), pos - prompt_len


def section_index(half: int, sections: tuple[int, int, int], interleaved: bool) -> torch.Tensor:
    """[half] int64: which of (t, h, w) each rotary frequency reads its position from. Interleaved (Qwen3-VL):
    h at 1, 4, 7, ... below 3 * sections[1], w at 2, 5, 8, ... below 3 * sections[2], t elsewhere; otherwise
    (Qwen2-VL) consecutive runs of sections[0], [1], [2] frequencies."""
    if sum(sections) != half:
        raise ValueError(f"mrope_section {list(sections)} must sum to half the rotary dims ({half})")
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(sections))
    index = torch.zeros(half, dtype=torch.int64)
    index[1:3 * sections[1]:3] = 1
    index[2:3 * sections[2]:3] = 2
    return index
