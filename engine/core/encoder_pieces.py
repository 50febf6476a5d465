"""Layer-chunked image encoding, the scheduler's side: which of the vision tower's stages a step runs for which image.

Without it a step that first reaches an image encodes the whole image (``max_num_encoder_tokens`` bounds how many
images, not how long one takes). With a budget of ``token_blocks`` a step runs at most that many *token-blocks* of
tower work, one token-block being one patch (an image token before merging) through one tower stage: an image of
``p`` patches in a tower of ``depth`` stages costs ``p * depth`` in all, spread over as many steps as the budget
needs. The stages are the patch embedding (as long as a block; the image's preprocessing runs before, off the
step loop: ``engine.serving.image_preparation``) then each block;
the merger runs with the last. Each step's pieces (``EncoderPiece``) run on rank 0 before the step's forward (``ImageFeatures
.encode_pieces``), which keeps the image's state between steps; the request's prompt chunk stops before an image
until the step that runs its last stage (that step's chunk may then take the image's placeholders: the features
are ready before the forward reads them). A step's first piece runs at least one stage, so an image one stage of
which passes the budget still advances, one stage a step.

Progress is the request's (``Request.encoder_blocks``): it survives preemption, as the model keeps the partial
state (and finished features) until the request finishes. Images the encoder cache holds cost nothing and get no
pieces. Plain Python, no torch.
"""

from dataclasses import dataclass

from engine.core.request import Request


@dataclass(frozen=True, slots=True)
class EncoderPiece:
    """Stages ``first..end-1`` of the tower over image ``image`` of ``request`` (rank 0's plan only; stage 0 is
    the patch embedding, stage ``s`` > 0 block ``s - 1``)."""

    request: Request
    image: int
    first: int
    end: int


class EncoderSteps:
    """Plans each step's pieces within ``token_blocks`` for a tower of ``depth`` stages whose image tokens each
    merge ``patches_per_token`` patches. ``begin_step`` at each plan, ``plan`` per chunk, ``commit`` what runs."""

    def __init__(self, token_blocks: int, depth: int, patches_per_token: int) -> None:
        assert token_blocks >= 1 and depth >= 1 and patches_per_token >= 1
        self.token_blocks, self.depth, self.patches_per_token = token_blocks, depth, patches_per_token
        self.used = 0  # token-blocks this step's pieces take so far
        self.pieces: list[EncoderPiece] = []

    def begin_step(self) -> None:
        self.used, self.pieces = 0, []

    def cost(self, piece: EncoderPiece) -> int:
        """Token-blocks ``piece`` takes: its image's patches times its stages."""
        return piece.request.images[piece.image].num_tokens * self.patches_per_token * (piece.end - piece.first)

    def plan(self, request: Request, start: int, num_new: int,
             to_encode: list[tuple[int, int]]) -> tuple[int, list[EncoderPiece]]:
        """(tokens of the chunk ``[start, start + num_new)`` that may run this step, the pieces to run for it):
        ``to_encode`` are (index, tokens to encode; 0: the cache holds it) of the images the chunk first touches,
        in order. The chunk stops before the first image whose last stage does not run this step."""
        pieces: list[EncoderPiece] = []
        used = self.used
        for i, tokens in to_encode:
            if not tokens:
                continue
            done = request.encoder_blocks.get(i, 0)
            patches = tokens * self.patches_per_token
            k = min(self.depth - done, (self.token_blocks - used) // patches)
            if k <= 0 and used == 0:
                k = 1  # one stage of it passes the budget: it runs alone, one stage a step
            if k > 0:
                pieces.append(EncoderPiece(request, i, done, done + k))
                used += k * patches
            if done + k < self.depth:
                return max(request.images[i].offset - start, 0), pieces
        return num_new, pieces

    def commit(self, pieces: list[EncoderPiece]) -> None:
        """The pieces run this step: the budget spent, each request's progress advanced, finished images marked
        encoded (the scheduler charges them nothing more)."""
        for piece in pieces:
            self.used += self.cost(piece)
            self.pieces.append(piece)
            piece.request.encoder_blocks[piece.image] = piece.end
            if piece.end == self.depth:
                piece.request.encoded_images.add(piece.image)
