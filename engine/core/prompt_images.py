"""The images a request's prompt holds, as the scheduler sees them (plain Python: the pixels are opaque here)."""

from dataclasses import dataclass
from typing import Any


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


def image_key(images: tuple[PromptImage, ...], start: int, end: int) -> bytes | None:
    """The digests of the images with placeholder tokens in [start, end), in order; None if there are none."""
    parts = [im.digest for im in images if im.offset < end and im.end > start]
    return b"".join(parts) if parts else None
