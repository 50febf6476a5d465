"""The images a request's prompt holds, as the scheduler sees them (plain Python: the pixels are opaque here)."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class PromptImage:
    """One image of a prompt: its run of placeholder tokens, its grid, and its content.

    ``digest`` (of the pixels the tower reads) enters the prefix-cache key of every block holding one of its
    placeholder tokens, so the same text with another image never shares those blocks (nor any after them: the
    keys are chained). ``pixels`` is the preprocessed image (``engine.vision``), read only by the model.
    """

    offset: int  # prompt index of the first placeholder token
    rows: int  # placeholder tokens down (merge windows)
    cols: int  # placeholder tokens across
    digest: bytes
    pixels: Any

    @property
    def num_tokens(self) -> int:
        return self.rows * self.cols

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


class ImageRun(Protocol):
    """What a block key reads of an image: its run of placeholder tokens [offset, end) and its digest."""

    @property
    def offset(self) -> int: ...

    @property
    def end(self) -> int: ...

    @property
    def digest(self) -> bytes: ...


def image_key(images: Sequence[ImageRun], start: int, end: int) -> bytes | None:
    """The digests of the images with placeholder tokens in [start, end), in order; None if there are none."""
    parts = [im.digest for im in images if im.offset < end and im.end > start]
    return b"".join(parts) if parts else None


def placeholder_runs(prompt_ids: Sequence[int], token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of ``token_id`` in the prompt."""
    runs, i = [], 0
    while i < len(prompt_ids):
        if prompt_ids[i] == token_id:
            j = i
            while j < len(prompt_ids) and prompt_ids[j] == token_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs
