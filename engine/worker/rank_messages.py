"""What an engine process sends its other ranks on the plans' channel: a msgspec tagged union, one struct per kind
of message, encoded as msgpack and broadcast as bytes over the control group (``TensorParallel.broadcast_bytes``).
Tensors never travel here: the weights a ``Rebalance`` moves and the blocks ``TierCopies`` name go through
``torch.distributed`` collectives of their own.

Between two steps rank 0 may send, in this order: ``LoraReads`` (adapters whose reads it began: the other ranks
begin theirs), ``LoraLoads`` (slot writes), ``TierCopies`` (prefix-cache tier copies of their slices of the same
blocks), a ``Rebalance`` (new expert placements); then the step's ``StepPlan``. Outside steps: ``AskStageTimings``
(a pipelined engine's statistics, answered by an all-gather) and, last, ``Stop``. ``ModelRunner.follow`` holds a
handler per message but ``Stop``, which ends the follower's loop. A message this version does not know (another
moegate's rank) is a ``RankMessageError`` naming it, never a guess.
"""

import msgspec

from engine.core.lora_residency import LoraLoads, LoraReads
from engine.core.scheduler import ScheduledRequest, SchedulerOutput
from engine.core.tier_copies import TierCopies
from engine.distributed.collectives import TensorParallel
from engine.eplb.balancer import Rebalance


class PlanPart(msgspec.Struct, frozen=True, array_like=True):
    """One scheduled part of a step as the other ranks get it: ``ScheduledRequest``'s fields without the
    scheduler's ``Request`` (same names, same order; see there what each means)."""

    num_new_tokens: int
    block_ids: list[int]
    sample: bool
    start: int
    token_ids: list[int]
    prompt_logprob_rows: int
    draft_token_ids: list[int]
    window_block_ids: list[int]
    lora_adapter: str | None
    state_slot: int

    @classmethod
    def of(cls, part: ScheduledRequest) -> "PlanPart":
        return cls(part.num_new_tokens, part.block_ids, part.sample, part.start, part.token_ids,
                   part.prompt_logprob_rows, part.draft_token_ids, part.window_block_ids,
                   part.request.policy.lora_adapter, part.state_slot)

    def scheduled(self) -> ScheduledRequest:
        """The part as the runner takes it (``request`` None)."""
        return ScheduledRequest(None, *msgspec.structs.astuple(self))


class StepPlan(msgspec.Struct, frozen=True, tag=True):
    """A step's plan (``SchedulerOutput``) as plain data for the other ranks: its parts (``StepPlan.of``). No
    parts: a dummy step (this replica has no work while a peer replica sharing its experts has); on a pipelined
    engine, no micro-batch (it finishes an overlapped step in flight)."""

    parts: list[PlanPart]
    # A hybrid model's state-checkpoint copies (``SchedulerOutput.state_loads``/``state_saves``): every rank
    # copies its own heads' states before and after the forward.
    state_loads: list[tuple[int, int]] = []
    state_saves: list[tuple[int, int]] = []

    @classmethod
    def of(cls, plan: SchedulerOutput) -> "StepPlan":
        return cls([PlanPart.of(s) for s in plan.scheduled], plan.state_loads, plan.state_saves)

    def scheduled(self) -> list[ScheduledRequest]:
        return [part.scheduled() for part in self.parts]


class AskStageTimings(msgspec.Struct, frozen=True, tag=True):
    """The engine process asks how each rank of a pipelined engine spent its time (``StageTiming``): every rank
    answers with an all-gather on the same channel."""


class Stop(msgspec.Struct, frozen=True, tag=True):
    """The engine is closing: a follower rank's loop returns."""


# Every message of the channel: those of a step's sequence, then those outside steps.
RankMessage = StepPlan | Rebalance | TierCopies | LoraLoads | LoraReads | AskStageTimings | Stop


class RankMessageError(ValueError):
    """Bytes on the plans' channel that are no message of this version (a rank of another moegate version)."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RankMessage)


def encode(message: RankMessage) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> RankMessage:
    """The message ``data`` encodes; RankMessageError if it is none this version knows."""
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as e:  # ValidationError included: an unknown tag, a missing field
        raise RankMessageError(f"the plans' channel carried no message this rank understands ({e})") from None


def send_message(channel: TensorParallel, message: RankMessage | bytes) -> None:
    """Rank 0: broadcast ``message`` (or its ``encode``-d bytes) to the channel's other ranks."""
    channel.broadcast_bytes(message if isinstance(message, bytes) else encode(message))


def receive_message(channel: TensorParallel) -> RankMessage:
    """A follower rank: the next message rank 0 sends on ``channel``."""
    return decode(channel.broadcast_bytes())
