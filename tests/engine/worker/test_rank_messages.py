"""The plans' channel between an engine process and its other ranks carries one type per kind of message, and a
follower rank hands each to its own handler: a plan is a ``StepPlan`` (never told from the others by being a
list), the engine's end a ``Stop`` (never None). The ranks' tests (tests/distributed) run the channel for real."""

import random
import typing

import pytest

from engine.core.lora_residency import LoraLoads, LoraReads
from engine.core.scheduler import ScheduledRequest
from engine.core.tier_copies import TierCopies
from engine.eplb.balancer import Rebalance
from engine.worker.rank_messages import AskStageTimings, RankMessage, StepMessage, StepPlan, Stop
from engine.worker.runner import FOLLOW, ModelRunner


class _Recorder:
    """What a follower's handlers reach: the balancer, the tier mirror, the adapters, and the step's forward."""

    def __init__(self) -> None:
        self.calls = []
        self.eplb = self.tier_mirror = self.lora = self
        self.forwards = []

    def apply(self, what) -> None:
        self.calls.append(("apply", what))

    def prefetch(self, reads) -> None:
        self.calls.append(("prefetch", reads))

    def _follow_plan(self, message) -> None:
        self.forwards.append(message)


def test_every_step_message_has_its_own_handler():
    assert set(FOLLOW) == set(typing.get_args(StepMessage))
    assert set(typing.get_args(RankMessage)) == set(typing.get_args(StepMessage)) | {AskStageTimings, Stop}


def test_a_follower_hands_each_message_to_its_handler(monkeypatch):
    rng = random.Random()
    assert FOLLOW[StepPlan] is ModelRunner._follow_plan  # the forward, replaced here by a recorder
    monkeypatch.setitem(FOLLOW, StepPlan, lambda runner, message: runner._follow_plan(message))
    runner = _Recorder()
    plan = StepPlan([ScheduledRequest(None, rng.randint(1, 9), [rng.randint(0, 99)], True, 0, [rng.randint(0, 99)])])
    rebalance = Rebalance([[rng.randint(0, 7) for _ in range(4)]])
    copies = TierCopies(((rng.randint(0, 99), 0),), ())
    loads = LoraLoads(())
    reads = LoraReads((("a", f"/adapters/{rng.randint(0, 99)}"),))
    for message in (plan, rebalance, copies, loads, reads, StepPlan([])):
        ModelRunner.follow(runner, message)
    assert runner.forwards == [plan, StepPlan([])]
    assert runner.calls == [("apply", rebalance), ("apply", copies), ("apply", loads.loads),
                            ("prefetch", reads.reads)]
    # What the channel carried before it was typed is no message: a bare list of parts, None.
    for untyped in (plan.parts, [], None):
        with pytest.raises(KeyError):
            ModelRunner.follow(runner, untyped)
