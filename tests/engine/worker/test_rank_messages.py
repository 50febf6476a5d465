"""The plans' channel between an engine process and its other ranks: a msgspec tagged union. Every kind of message
comes back from its bytes equal to what was sent (a plan's parts as the ``ScheduledRequest``s rank 0 scheduled, less
the scheduler's ``Request``), bytes naming a kind this version does not know are a ``RankMessageError`` naming it,
and a follower rank hands each kind to its own handler. The ranks' tests (tests/distributed) run the channel over
real process groups."""

import dataclasses
import random
import typing

import msgspec
import pytest

from engine.core.lora_residency import LoraLoad, LoraLoads, LoraReads
from engine.core.request_policy import RequestPolicy
from engine.core.scheduler import ScheduledRequest, SchedulerOutput
from engine.core.tier_copies import TierCopies
from engine.eplb.balancer import Rebalance
from engine.worker import rank_messages
from engine.worker.rank_messages import (
    AskStageTimings, PlanPart, RankMessage, RankMessageError, StepPlan, Stop, decode, encode,
)
from engine.worker.runner import FOLLOW, ModelRunner


def _ints(rng: random.Random, most: int = 6) -> list[int]:
    return [rng.randint(-1, 10**6) for _ in range(rng.randint(0, most))]


class _Request:
    """What ``PlanPart.of`` reads of the scheduler's request: its policy's adapter."""

    def __init__(self, adapter: str | None) -> None:
        self.policy = RequestPolicy(lora_adapter=adapter)


def _scheduled(rng: random.Random) -> ScheduledRequest:
    """A part with every field drawn at random (the request only to carry its adapter)."""
    adapter = rng.choice([None, f"a{rng.randint(0, 99)}=/adapters/{rng.randint(0, 99)}#d"])
    return ScheduledRequest(_Request(adapter), rng.randint(1, 64), _ints(rng), rng.random() < 0.5, rng.randint(0, 999),
                            _ints(rng), rng.randint(0, 5), _ints(rng, 3), _ints(rng), None, rng.randint(-1, 30))


def _one_of_each(rng: random.Random) -> list[RankMessage]:
    plan = SchedulerOutput([_scheduled(rng) for _ in range(rng.randint(1, 4))], rng.randint(1, 99))
    pairs = lambda: tuple((rng.randint(0, 999), rng.randint(0, 999)) for _ in range(rng.randint(1, 4)))  # noqa: E731
    return [StepPlan.of(plan), StepPlan([]), Rebalance([_ints(rng) for _ in range(rng.randint(1, 3))]),
            TierCopies(pairs(), pairs()),
            LoraLoads(tuple(LoraLoad(rng.randint(1, 8), f"n{rng.randint(0, 99)}", f"/p/{rng.random()}")
                            for _ in range(rng.randint(1, 3)))),
            LoraReads(((f"k{rng.randint(0, 99)}", f"/p/{rng.random()}"),)), AskStageTimings(), Stop()]


def test_every_kind_of_message_round_trips_through_its_bytes():
    rng = random.Random()
    messages = _one_of_each(rng)
    assert {type(m) for m in messages} == set(typing.get_args(RankMessage))
    for message in messages:
        back = decode(encode(message))
        assert type(back) is type(message) and back == message
        assert msgspec.to_builtins(back) == msgspec.to_builtins(message)


def test_a_plan_reaches_the_other_ranks_as_the_parts_rank_0_scheduled():
    rng = random.Random()
    plan = SchedulerOutput([_scheduled(rng) for _ in range(3)], 0)
    received = decode(encode(StepPlan.of(plan))).scheduled()
    for sent, got in zip(plan.scheduled, received, strict=True):
        # Every field but the request, which the part's adapter stands for.
        expected = dataclasses.replace(sent, request=None, lora_adapter=sent.request.policy.lora_adapter)
        assert got == expected
    # The wire part is the runner's part less its request, field for field: a field added to one is added to both.
    assert PlanPart.__struct_fields__ == tuple(f.name for f in dataclasses.fields(ScheduledRequest))[1:]


def test_bytes_that_are_no_message_of_this_version_fail_naming_what_they_are():
    rng = random.Random()
    unknown = msgspec.msgpack.encode({"type": f"Resize{rng.randint(0, 99)}", "blocks": _ints(rng)})
    with pytest.raises(RankMessageError, match=r"Resize\d+"):
        decode(unknown)
    with pytest.raises(RankMessageError, match="parts"):  # a known kind without its fields
        decode(msgspec.msgpack.encode({"type": "StepPlan"}))
    with pytest.raises(RankMessageError):  # what the channel carried when it pickled: a bare list of parts
        decode(msgspec.msgpack.encode([_ints(rng, 1)]))


class _Recorder:
    """What a follower's handlers reach: the balancer, the tier mirror, the adapters, the stage's timing."""

    def __init__(self) -> None:
        self.calls = []
        self.eplb = self.tier_mirror = self.lora = self.plans = self
        self.stage = self
        self.timing = object()

    def apply(self, what) -> None:
        self.calls.append(("apply", what))

    def prefetch(self, reads) -> None:
        self.calls.append(("prefetch", reads))

    def all_gather_object(self, what) -> None:
        self.calls.append(("gather", what))


def test_a_follower_hands_each_message_to_its_handler(monkeypatch):
    rng = random.Random()
    assert set(FOLLOW) == set(typing.get_args(RankMessage)) - {Stop}  # Stop ends the follower's loop instead
    assert FOLLOW[StepPlan] is ModelRunner._follow_step  # the forward, replaced here by a recorder
    forwards = []
    monkeypatch.setitem(FOLLOW, StepPlan, lambda runner, message: forwards.append(message))
    runner = _Recorder()
    plan, empty, rebalance, copies, loads, reads, ask, stop = (decode(encode(m)) for m in _one_of_each(rng))
    for message in (plan, rebalance, copies, loads, reads, ask, empty):
        ModelRunner.follow(runner, message)
    assert forwards == [plan, empty]
    assert runner.calls == [("apply", rebalance), ("apply", copies), ("apply", loads.loads),
                            ("prefetch", reads.reads), ("gather", runner.timing)]
    for no_handler in (stop, plan.parts, None):
        with pytest.raises(TypeError, match="no handler"):
            ModelRunner.follow(runner, no_handler)


def test_send_and_receive_go_through_the_channels_bytes():
    """One rank alone: the channel hands back what it is given (a group of one has no collective)."""
    rng = random.Random()

    class _Channel:
        def __init__(self) -> None:
            self.sent = None

        def broadcast_bytes(self, data=None):
            self.sent = data if data is not None else self.sent
            return self.sent

    channel = _Channel()
    for message in _one_of_each(rng):
        rank_messages.send_message(channel, message)
        assert isinstance(channel.sent, bytes) and rank_messages.receive_message(channel) == message
