"""State checkpoints: the prefix cache's half for linear-attention layers (plain Python, no torch).

A prefix-cache hit on a hybrid model must also give the linear-attention layers the fixed-size state they had
after the hit's last token, which the KV blocks do not hold. A checkpoint is a copy of a request's state-slot
rows (every linear layer's state tensors, whatever the layer kind) taken right after the forward whose chunk
ended at a block boundary, kept in one of ``num_checkpoints`` extra rows of the state cache, under the same
prefix-cache key as the KV block that ends there (the chained hash, salted per tenant and keyed by the LoRA
adapter). So a hit on block i of the full-attention layers is a hit for the linear layers only where block
i's key has a checkpoint: the scheduler cuts each hit back to its last such block (``resumable``).

Which boundaries: each prompt's last full block that a later identical prompt can hit ((L - 1) // block_size:
the last token is always computed again), every ``interval`` blocks of a sequence, and where a request's KV hit
ends past its last checkpoint (``note_hit``): there its prompt leaves one an earlier request computed, so that is
where the requests sharing a system prompt diverge, and the next ones resume there rather than at the last
multiple of ``interval`` (none at all for a prompt shorter than the interval); a request whose hit ends where
another's checkpoint is being taken waits for it (``being_saved``) rather than compute the prefix again. A chunk of a prompt is cut
at the last such boundary inside it so that the slot holds the state of exactly that prefix after the forward
(``cap``).

Ordering, without locks: a plan's loads (checkpoint row -> the admitted request's slot) run before its forward,
its saves (slot -> checkpoint row) after it; a checkpoint becomes findable only when the scheduler sees its
chunk computed (``commit``), so a load always comes in a later plan than its save. A row is reused only by a
save, which runs after that plan's loads. The rows are a fixed share of the KV memory (bounded: they never take
KV blocks), evicted least recently used first, those whose KV blocks left the pool before any other.
"""

from collections import OrderedDict
from collections.abc import Callable

from engine.core.block_pool import Block
from engine.core.request import Request


class StateCheckpoints:
    def __init__(self, num_checkpoints: int, first_row: int, block_size: int, interval: int) -> None:
        """Rows ``first_row .. first_row + num_checkpoints - 1`` of the state cache (after the running requests'
        slots); ``interval``: a checkpoint every this many blocks (besides each prompt's last full block)."""
        assert num_checkpoints >= 1 and interval >= 1
        self.num_checkpoints = num_checkpoints
        self.block_size = block_size
        self.interval = interval
        self._free = list(range(first_row + num_checkpoints - 1, first_row - 1, -1))  # popped from the end
        self._rows: OrderedDict[bytes, int] = OrderedDict()  # key -> row, least recently used first
        self._pending: dict[str, list[tuple[int, int]]] = {}  # request -> (boundary in blocks, row) not committed
        self._saving: dict[bytes, str] = {}  # key -> the request whose planned save will file it
        self._divergence: dict[str, int] = {}  # request -> where its KV hit ended past its checkpoints, in blocks
        self._loads: list[tuple[int, int]] = []  # (row, slot) of the plan being built
        self._saves: list[tuple[int, int]] = []  # (slot, row) of the plan being built
        self.num_saved = 0
        self.num_evicted = 0

    @property
    def num_held(self) -> int:
        """Checkpoints findable now."""
        return len(self._rows)

    def is_boundary(self, request: Request, num_blocks: int) -> bool:
        """Whether the state after ``num_blocks`` full blocks of ``request`` is checkpointed."""
        return num_blocks >= 1 and (num_blocks % self.interval == 0
                                    or num_blocks == (request.num_prompt_tokens - 1) // self.block_size
                                    or num_blocks == self._divergence.get(request.request_id))

    def note_hit(self, request: Request, hit_blocks: int, resumable_blocks: int) -> None:
        """At admission: ``request``'s prompt shares ``hit_blocks`` blocks with KV in the pool, of which the linear
        layers resume after ``resumable_blocks``. Where the KV hit runs further, the prompt it shares them with
        went on differently (or is still being computed): the state after ``hit_blocks`` blocks becomes a
        boundary of this request, so later requests of that prefix resume there."""
        if hit_blocks > resumable_blocks:
            self._divergence[request.request_id] = hit_blocks
        else:
            self._divergence.pop(request.request_id, None)

    def cap(self, request: Request, start: int, num_new: int) -> int:
        """``num_new`` tokens from position ``start``, cut at the last checkpoint boundary strictly inside them
        (a chunk that ends at one is left whole): the slot then holds that prefix's state after the forward. The
        boundaries a chunk passes before its last are not checkpointed: a prompt's chunks are cut once each at
        most, so the interval in effect is at least the chunk size. Where its hit ended (``note_hit``) comes first:
        the state later requests of a shared prefix resume from."""
        bs, end = self.block_size, start + num_new
        divergence = self._divergence.get(request.request_id, 0) * bs
        if start < divergence < end:
            return divergence - start
        if end % bs == 0 and self.is_boundary(request, end // bs):
            return num_new
        for k in range((end - 1) // bs, start // bs, -1):
            if self.is_boundary(request, k):
                return k * bs - start
        return num_new

    def resumable(self, blocks: list[Block]) -> int:
        """How many of a hit's leading pool blocks the linear layers can resume after: up to the last one whose
        key holds a checkpoint (0: none)."""
        for n in range(len(blocks), 0, -1):
            if blocks[n - 1].block_hash in self._rows:
                return n
        return 0

    def being_saved(self, key: bytes) -> bool:
        """Whether a save under ``key`` is planned and not yet committed (findable after a step or two)."""
        return key in self._saving

    def plan_load(self, key: bytes, slot: int) -> None:
        """Copy the checkpoint under ``key`` into ``slot`` before this plan's forward (a hit of ``resumable``)."""
        row = self._rows[key]
        self._rows.move_to_end(key)
        self._loads.append((row, slot))

    def plan_save(self, request_id: str, boundary: int, key: bytes | None, slot: int,
                  still_cached: Callable[[bytes], bool]) -> None:
        """Copy ``slot`` into a row after this plan's forward, whose chunk ends at ``boundary`` blocks. ``key``:
        that prefix's key where its tokens are known now (one already checkpointed is not saved twice).
        ``still_cached``: whether a key's KV block is still in the pool (rows whose blocks left go first)."""
        if key is not None and key in self._rows:
            self._rows.move_to_end(key)
            return
        row = self._take_row(still_cached)
        if row is None:
            return  # every row waits for its own save to be committed: this prefix goes uncheckpointed
        self._saves.append((slot, row))
        if key is not None:
            self._saving[key] = request_id
        self._pending.setdefault(request_id, []).append((boundary, row))

    def _take_row(self, still_cached: Callable[[bytes], bool]) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._rows:
            return None
        victim = next((k for k in self._rows if not still_cached(k)), next(iter(self._rows)))
        self.num_evicted += 1
        return self._rows.pop(victim)

    def commit(self, request: Request, key_of: Callable[[int], bytes]) -> None:
        """Make findable the checkpoints of ``request`` whose chunks are computed; ``key_of(k)``: the key of its
        first k blocks."""
        pending = self._pending.get(request.request_id)
        if not pending:
            return
        done = [(k, row) for k, row in pending if k * self.block_size <= request.num_computed_tokens]
        for k, row in done:
            key = key_of(k)
            self._saving.pop(key, None)
            if key in self._rows:  # an identical prefix was checkpointed meanwhile: keep one
                self._free.append(row)
            else:
                self._rows[key] = row
                self.num_saved += 1
        rest = [p for p in pending if p not in done]
        if rest:
            self._pending[request.request_id] = rest
        else:
            del self._pending[request.request_id]

    def drop(self, request_id: str) -> None:
        """Forget the saves a preempted or finished request had not committed (their copies still run)."""
        self._divergence.pop(request_id, None)  # a preempted request notes its hit again when readmitted
        for key in [k for k, owner in self._saving.items() if owner == request_id]:
            del self._saving[key]
        for _, row in self._pending.pop(request_id, ()):
            self._free.append(row)

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(loads, saves) of the plan just built: (from row, to row) pairs of the state cache."""
        loads, saves = self._loads, self._saves
        self._loads, self._saves = [], []
        return loads, saves

    def check_consistent(self) -> None:
        """Every row is free, pending or held, exactly once (tests)."""
        pending = [row for rows in self._pending.values() for _, row in rows]
        rows = self._free + pending + list(self._rows.values())
        assert sorted(rows) == sorted(set(rows)) and len(rows) == self.num_checkpoints, \
            (self._free, pending, self._rows)
