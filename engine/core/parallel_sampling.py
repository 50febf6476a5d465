"""``n`` > 1: copies of one prompt that share its prefill (plain Python, no torch).

A request with ``SamplingParams.n = k`` becomes k sequences (``Request``s with
ids ``"{id}#{i}"``, ``parent_id`` the caller's id, ``index`` i). Only the first
(the leader) enters the scheduler at once; the others are held here until the
leader has computed its prompt, by which time the prompt's full blocks are
registered in the prefix cache. The copies then find those blocks at
admission (a reference each, no compute) and compute only the prompt's last,
partial block (or its last token, which must be computed for its logits).

Correct under preemption by construction: sharing goes through the prefix
cache's content hashes, so a copy admitted after the leader's blocks were
evicted just computes them again. With prefix caching off the copies are
released at once and each computes the whole prompt.
"""

import hashlib

import msgspec

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams

_INT63 = 2**63 - 1


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed choice ``index`` draws from: ``seed`` itself for choice 0 (so n=1 and choice 0 of n>1
    agree), a hash of (seed, index) for the others; None stays None (unseeded)."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _INT63


def choice_params(sampling_params: SamplingParams, index: int) -> SamplingParams:
    """One copy's settings: n=1 and its own seed."""
    return msgspec.structs.replace(sampling_params, n=1, seed=choice_seed(sampling_params.seed, index))


def child_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"


class ChoiceGroups:
    """The copies of each ``n`` > 1 request: which are held back, and which ids to abort together."""

    def __init__(self, share_prefill: bool) -> None:
        self.share_prefill = share_prefill
        self._members: dict[str, list[Request]] = {}  # parent id -> its copies, by index
        self._held: dict[str, list[Request]] = {}  # parent id -> copies not yet given to the scheduler

    def add(self, parent_id: str, copies: list[Request]) -> list[Request]:
        """Record a group; returns the copies to schedule now (the rest wait for ``release``)."""
        self._members[parent_id] = copies
        if not self.share_prefill:
            return copies
        self._held[parent_id] = copies[1:]
        return copies[:1]

    def members(self, parent_id: str) -> list[Request]:
        return self._members.get(parent_id, [])

    def release(self) -> list[Request]:
        """Held copies whose leader has computed its whole prompt (or ended): schedule them now.

        The prompt counts as computed once the scheduler has accounted for it (billed it, and registered its
        full blocks in the prefix cache): with overlapped steps that is when the step's results are read, one
        step after its computed count moved, and copies admitted earlier would find no blocks to share."""
        ready = []
        for parent_id, held in list(self._held.items()):
            leader = self._members[parent_id][0]
            if leader.is_finished or leader.num_charged_prompt_tokens >= leader.num_prompt_tokens:
                ready += held
                del self._held[parent_id]
        return ready

    def forget(self, parent_id: str) -> list[Request]:
        """Drop a group (aborted or done); returns its copies that were still held (never scheduled)."""
        self._members.pop(parent_id, None)
        return self._held.pop(parent_id, [])

    def finished(self, parent_id: str) -> bool:
        return all(r.is_finished for r in self._members.get(parent_id, ()))

    def __contains__(self, parent_id: str) -> bool:
        return parent_id in self._members
