"""Layer-chunked image encoding, the scheduler's side: which of the vision tower's work a step runs for which image.

Without it a step that first reaches an image encodes the whole image (``max_num_encoder_tokens`` bounds how many
images, not how long one takes). With a budget of ``token_blocks`` a step runs at most that many *token-blocks* of
tower work, one token-block being one patch (an image token before merging) through one tower stage: an image of
``p`` patches in a tower of ``depth`` stages costs ``p * depth`` in all, spread over as many steps as the budget
needs. The stages are the patch embedding (as long as a block; the image's preprocessing runs before, off the
step loop: ``engine.serving.image_preparation``) then each block; the merger runs with the last. A stage is split
over the image's rows (``engine.vision.tower_rows``): ``2p`` *passes*, a block's projection of each row then its
mixing of each row, so a pass is half a token-block and a step's tower work stays within the budget however large
one block of one image is (a budget of one token-block still advances an image every step, up to two
passes).

A block also pays for its attention, which its weights do not count, in the passes that run it: with
``attention_per_patch`` ``a`` (``engine.models.encoder_budget.attention_per_patch``) a block's mixing of a row
(where the row's query meets every key of an image of ``p`` patches) costs ``1 + 2 a p`` half token-blocks, its
projection of a row and a patch embedding's pass one (so a block's token-block costs ``1 + a p`` in all). A pass
past the whole budget (one row's attention over a very large image, under a very small budget) could never fit:
each step runs one such pass after whatever else fits, so that image advances even behind other image work in
every step (a step's tower work is then its budget and that one pass, at most).

Each step's pieces (``EncoderPiece``: a range of passes of one image) run on rank 0 before the step's forward
(``ImageFeatures.encode_pieces``), which keeps the image's state between steps; the request's prompt chunk stops
before an image until the step that runs its last pass (that step's chunk may then take the image's
placeholders: the features are ready before the forward reads them).

Progress is the request's (``Request.encoder_blocks``, in passes): it survives preemption, as the model keeps the
partial state (and finished features) until the request finishes. Images the encoder cache holds cost nothing and
get no pieces. Plain Python, no torch.
"""

from dataclasses import dataclass

from engine.core.request import Request


@dataclass(frozen=True, slots=True)
class EncoderPiece:
    """Passes ``first..end-1`` of the tower over image ``image`` of ``request`` (rank 0's plan only), of
    ``total``: stage ``s`` (0 the patch embedding, ``s`` > 0 block ``s - 1``) holds passes ``2ps..2p(s+1)-1`` for
    an image of ``p`` patches."""

    request: Request
    image: int
    first: int
    end: int
    total: int


ImageKey = tuple[bytes, "str | None"]  # (the pixels' digest, the tenant's cache salt): the encoder cache's key

# Plans an image stays owned for after its owner last advanced it: after its last pass, so that a request waiting
# for it finds it in the encoder cache (its tower runs after its plan; with overlapped scheduling the next step is
# planned before it runs); before, so that a waiter takes over from an owner that stopped advancing it (one that
# cannot be admitted while the waiters hold the slots, or a background request held back by foreground work).
FINISHING_PLANS = 2


def _mixing(n: int, p: int) -> int:
    """Mixing passes among the first ``n`` of an image of ``p`` patches: stage ``s`` > 0 mixes in its second
    ``p`` passes (the patch embedding, stage 0, mixes nothing)."""
    stage, within = divmod(n, 2 * p)
    return p * max(stage - 1, 0) + (max(within - p, 0) if stage else 0)


class EncoderSteps:
    """Plans each step's pieces within ``token_blocks`` for a tower of ``depth`` stages whose image tokens each
    merge ``patches_per_token`` patches. ``begin_step`` at each plan, ``plan`` per chunk, ``commit`` what runs,
    ``release`` a request finished or preempted.

    One image in progress per key: a request whose image another request is encoding (the same pixels, the same
    cache salt) waits for that one to finish and then reads the encoder cache, as whole images do within a step,
    so requests sent together with one document run the tower over it once. It waits only while the owner
    advances the image (in this plan or the last ``FINISHING_PLANS - 1``); an owner that stops (not scheduled:
    waiting for a slot, held back by its class) loses the image to the first request that plans it then, which
    begins it itself, so no request waits for work that is not being done. With ``share`` False (an encoder cache
    that keeps nothing, where a waiter would find nothing to read) no request waits."""

    def __init__(self, token_blocks: int, depth: int, patches_per_token: int, share: bool = True,
                 attention_per_patch: float = 0.0) -> None:
        assert token_blocks >= 1 and depth >= 1 and patches_per_token >= 1 and attention_per_patch >= 0
        self.token_blocks, self.depth, self.patches_per_token = token_blocks, depth, patches_per_token
        self.share = share
        self.attention_per_patch = attention_per_patch
        self.used = 0.0  # what this step's pieces cost so far, in passes of no attention (two a token-block)
        self.pieces: list[EncoderPiece] = []
        self.past_budget = False  # whether this step runs a pass past the whole budget (one a step)
        self.owners: dict[ImageKey, tuple[str, int]] = {}  # image -> (the request encoding it, the plan it last ran in)
        self._plans = 0

    def begin_step(self) -> None:
        self.used, self.pieces, self.past_budget = 0.0, [], False
        self._plans += 1
        for key in [k for k, (_, plan) in self.owners.items() if plan <= self._plans - FINISHING_PLANS]:
            del self.owners[key]  # finished, or its owner stopped advancing it: a waiter may begin it

    def release(self, request_id: str) -> None:
        """A request finished or preempted: the images it was encoding are no one's (another may begin them)."""
        for key in [k for k, (owner, _) in self.owners.items() if owner == request_id]:
            del self.owners[key]

    def patches(self, request: Request, image: int) -> int:
        return request.images[image].num_tokens * self.patches_per_token

    def total(self, request: Request, image: int) -> int:
        """Passes the whole tower takes over image ``image`` of ``request``: two per patch and stage."""
        return 2 * self.patches(request, image) * self.depth

    def cost(self, request: Request, image: int, first: int, end: int) -> float:
        """What passes ``first..end-1`` over the image cost against the budget, in half token-blocks: one each,
        and a block's mixing pass of a row (the second ``p`` of its ``2p``, where the row's query meets every
        key: ``engine.vision.tower_rows``) also ``2 * attention_per_patch * p`` for that attention."""
        p = self.patches(request, image)
        return (end - first) + 2 * self.attention_per_patch * p * (_mixing(end, p) - _mixing(first, p))

    def _fitting(self, request: Request, image: int, done: int, room: float) -> int:
        """Passes of the image from ``done`` (at most to its last) whose cost fits in ``room``."""
        p, total = self.patches(request, image), self.total(request, image)
        mixing = 1 + 2 * self.attention_per_patch * p
        u, left = done, room
        while u < total and left > 0:  # a run of p passes at a time: a stage's embedding, projection or mixing
            half = u // p
            each = mixing if half >= 2 and half % 2 else 1
            n = min((half + 1) * p - u, int(left // each))
            u, left = u + n, left - n * each
            if u < (half + 1) * p:
                break
        while u > done and self.cost(request, image, done, u) > room:
            u -= 1  # the running sum rounded below the cost: never past the room
        return u - done

    def _past_budget(self, request: Request, image: int, first: int, end: int) -> bool:
        return self.cost(request, image, first, end) > 2 * self.token_blocks

    def plan(self, request: Request, start: int, num_new: int,
             to_encode: list[tuple[int, int]]) -> tuple[int, list[EncoderPiece]]:
        """(tokens of the chunk ``[start, start + num_new)`` that may run this step, the pieces to run for it):
        ``to_encode`` are (index, tokens to encode; 0: the cache holds it) of the images the chunk first touches,
        in order. The chunk stops before the first image whose last pass does not run this step."""
        pieces: list[EncoderPiece] = []
        used, past_budget = self.used, self.past_budget
        for i, tokens in to_encode:
            if not tokens:
                continue
            key = (request.images[i].digest, request.policy.cache_salt)
            if self.owners.get(key, (request.request_id,))[0] != request.request_id:
                return max(request.images[i].offset - start, 0), pieces  # another request is encoding it
            done, total = request.encoder_blocks.get(i, 0), self.total(request, i)
            k = self._fitting(request, i, done, 2 * self.token_blocks - used)
            if k == 0 and not past_budget and self._past_budget(request, i, done, done + 1):
                k, past_budget = 1, True  # a pass no step could hold: one a step, or that image never advances
            if k > 0:
                pieces.append(EncoderPiece(request, i, done, done + k, total))
                used += self.cost(request, i, done, done + k)
            if done + k < total:
                return max(request.images[i].offset - start, 0), pieces
        return num_new, pieces

    def commit(self, pieces: list[EncoderPiece]) -> None:
        """The pieces run this step: the budget spent, each request's progress advanced, finished images marked
        encoded (the scheduler charges them nothing more)."""
        for piece in pieces:
            self.used += self.cost(piece.request, piece.image, piece.first, piece.end)
            self.past_budget |= self._past_budget(piece.request, piece.image, piece.first, piece.end)
            self.pieces.append(piece)
            request = piece.request
            request.encoder_blocks[piece.image] = piece.end
            key = (request.images[piece.image].digest, request.policy.cache_salt)
            if self.share:
                self.owners[key] = (request.request_id, self._plans)
            if piece.end == piece.total:
                request.encoded_images.add(piece.image)
