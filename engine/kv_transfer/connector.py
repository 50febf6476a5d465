"""The connector interface: what an engine asks of whatever moves KV blocks between engines.

Per request, by block: the decode engine says which of its blocks a transfer fills (``load_blocks``), the
prefill engine which of its blocks it sends (``save_blocks``, the blocks found by their prefix hashes), in
pieces as a chunked prefill computes them (each piece names its first block's index in the transfer; the last
piece ends the transfer), so the transfer of the first chunks overlaps the compute of the next; both learn
from ``done`` when a transfer has ended. Blocks are bytes laid out as the engine's cache specs say
(``engine.kv_transfer.block_io``), so K/V caches and MLA latent caches move the same way. The default
connector is ``engine.kv_transfer.p2p`` (torch.distributed point-to-point); another transport (NIXL,
Mooncake's transfer engine) implements the same calls.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(slots=True)
class TransferResult:
    """One transfer that ended: ``ok`` (its blocks arrived and were written, or were sent), else ``error`` says
    why (the peer died, a timeout, the sender no longer held the blocks)."""

    pair_id: str
    transfer_id: int
    sent: bool  # this engine sent it (prefill side); False: received (decode side)
    ok: bool
    num_bytes: int = 0
    seconds: float = 0.0
    pieces: int = 0  # how many pieces carried its blocks (sent side: more than one when chunks overlapped)
    error: str | None = None


class KVConnector(ABC):
    """Moves blocks of the paged KV cache between two engines of a pair (a prefill and a decode engine)."""

    address: str | None  # where prefill engines reach this (decode) engine's side; None on a prefill engine

    @abstractmethod
    def pair(self, pair_id: str, rank: int, address: str) -> None:
        """Join pair ``pair_id`` (rank 0: the decode engine, 1: the prefill engine) meeting at ``address``;
        returns at once, the pair forms in the background."""

    @abstractmethod
    def save_blocks(self, pair_id: str, transfer_id: int, block_ids: list[int] | None, first: int = 0,
                    last: bool = True) -> None:
        """Send these blocks' contents (read now, on the caller's thread, so the blocks may be reused as soon as
        this returns) to the pair's decode engine as blocks ``first``, ``first + 1``, ... of ``transfer_id``;
        ``last``: the transfer ends with them (pieces go in order, each block once); None: the blocks are gone,
        tell the receiver so it stops waiting (this ends the transfer)."""

    @abstractmethod
    def load_blocks(self, pair_id: str, transfer_id: int, block_ids: list[int]) -> None:
        """Expect ``transfer_id`` from the pair's prefill engine into these blocks, in pieces (the caller holds
        them until ``done`` reports the transfer, or it aborts it)."""

    @abstractmethod
    def done(self) -> list[TransferResult]:
        """Transfers ended since the last call. Received pieces are written here, on the caller's thread (between
        steps), never while a step may read them, and only while their load is wanted; loads past their timeout
        end as failed."""

    @abstractmethod
    def close(self) -> None:
        """End every pair (the engine is stopping)."""

    @abstractmethod
    def abort(self, pair_id: str, transfer_id: int) -> None:
        """Stop waiting for a load: its data, if it still comes (the rest of its pieces), is drained and
        dropped, never written, so the caller may free its blocks now."""
