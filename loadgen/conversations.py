"""Multi-tenant multi-turn conversations: each tenant's own long system prompt, then turns that grow.

Turn ``t`` of a conversation is its system prompt, every earlier turn's user message and reply, and a new user
message: the shape that makes a prefix cache pay (everything but the new message was computed before). The
replies are the model's own outputs, known only once the turn before has run, so a conversation is a plan
(token ids of its system prompt and of each user message) and the runner appends each reply as it comes.
"""

import random
from dataclasses import dataclass, field


@dataclass(slots=True)
class Conversation:
    tenant: str
    system: list[int]
    user_turns: list[list[int]]
    max_tokens: int
    replies: list[list[int]] = field(default_factory=list)

    def prompt(self, turn: int) -> list[int]:
        """Token ids of turn ``turn``'s prompt (every earlier reply must be known)."""
        assert len(self.replies) >= turn
        ids = list(self.system)
        for t in range(turn):
            ids += self.user_turns[t] + self.replies[t]
        return ids + self.user_turns[turn]


def tenant_conversations(num_tenants: int, system_len: int, turns: int, user_len: tuple[int, int],
                         max_tokens: int, vocab: int, seed: int, shared_every: int = 0) -> list[Conversation]:
    """One conversation per tenant (``tenant-<i>``), each with its own random system prompt, except that with
    ``shared_every`` = k every k-th tenant uses tenant 0's system prompt verbatim (a common template: only
    the cache salt keeps their caches apart)."""
    rng = random.Random(seed)
    out = []
    for i in range(num_tenants):
        if shared_every and i and i % shared_every == 0:
            system = list(out[0].system)
        else:
            system = [rng.randrange(1, vocab - 1) for _ in range(system_len)]
        users = [[rng.randrange(1, vocab - 1) for _ in range(rng.randint(*user_len))] for _ in range(turns)]
        out.append(Conversation(f"tenant-{i}", system, users, max_tokens))
    return out
