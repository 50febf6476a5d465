"""The state cache's slots: which running request holds which fixed-size recurrent state (plain Python).

Hybrid models keep, per linear-attention layer, one state per running request whatever its length; the runner
allocates ``num_slots`` of them from the KV memory budget (``engine.worker.state_cache``). A request takes a slot
when admitted and gives it back when it finishes or is preempted (a preempted request's state is recomputed
from its first token on resume, as its KV is), so the number of slots bounds the running requests as
``max_num_seqs`` does.
"""


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        assert num_slots >= 1, num_slots
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._held: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, request_id: str) -> int:
        """A free slot for ``request_id`` (the caller checked ``num_free``)."""
        assert request_id not in self._held, f"{request_id} already holds state slot {self._held[request_id]}"
        slot = self._free.pop()
        self._held[request_id] = slot
        return slot

    def slot(self, request_id: str) -> int:
        return self._held[request_id]

    def free(self, request_id: str) -> None:
        """Give back ``request_id``'s slot, if it holds one."""
        slot = self._held.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def check_all_free(self) -> None:
        assert not self._held and len(self._free) == self.num_slots, f"state slots still held: {self._held}"
