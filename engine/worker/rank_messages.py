"""What an engine process sends its other ranks on the plans' channel, one type per kind of message (the channel
pickles them; each side tells them apart by type, never by shape).

Between two steps rank 0 may send, in this order: ``LoraReads`` (adapters whose reads it began: the other ranks
begin theirs), ``LoraLoads`` (slot writes), ``TierCopies`` (prefix-cache tier copies of their slices of the same
blocks), a ``Rebalance`` (new expert placements); then the step's ``StepPlan``. Outside steps: ``AskStageTimings``
(a pipelined engine's statistics, answered by an all-gather) and, last, ``Stop``. ``ModelRunner.follow`` holds a
handler per step message; the follower's loop answers the other two.
"""

from dataclasses import dataclass

from engine.core.lora_residency import LoraLoads, LoraReads
from engine.core.scheduler import ScheduledRequest
from engine.core.tier_copies import TierCopies
from engine.eplb.balancer import Rebalance


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step as plain data: each scheduled part without the scheduler's ``Request`` (``follower_plan``). No
    parts: a dummy step (this replica has no work while a peer replica sharing its experts has); on a pipelined
    engine, no micro-batch (it finishes an overlapped step in flight)."""

    parts: list[ScheduledRequest]


@dataclass(frozen=True, slots=True)
class AskStageTimings:
    """The engine process asks how each rank of a pipelined engine spent its time (``StageTiming``): every rank
    answers with an all-gather on the same channel."""


@dataclass(frozen=True, slots=True)
class Stop:
    """The engine is closing: a follower rank's loop returns."""


# A message within a step's sequence (what ``ModelRunner.follow`` takes).
StepMessage = StepPlan | Rebalance | TierCopies | LoraLoads | LoraReads
RankMessage = StepMessage | AskStageTimings | Stop
