"""The default connector: blocks over torch.distributed point-to-point, one two-process group per pair.

The decode engine hosts a TCP store (``EngineConfig.kv_transfer_address``); the gateway, pairing a prefill
engine with it, hands both its address and a fresh pair id, and each joins a gloo (CPU) or NCCL (GPU) group of
two ranks under that id's prefix of the store: the decode engine rank 0, the prefill engine rank 1. A restarted
prefill engine gets a new pair id, so nothing of the old pair is read again.

A gloo receive that times out closes the pair, so the receiver never posts a receive before data is on its way:
the sender first writes a header under ``seq/<n>`` in the store (transfer id, the piece's first block index,
its block count or -1 for "the blocks are gone", whether it is the last piece), then sends the payload; the
receiver waits on the store key (a timeout there breaks nothing), reads the header, and receives exactly that
payload. A transfer may come in several pieces (a chunked prefill sends the blocks of each chunk as it is
computed). Payloads land in a buffer of their own and are written into the cache by ``done`` on the engine's
thread, so a transfer the decode engine gave up on (aborted, timed out) is drained and dropped, every piece of
it still to come too, and never writes a block that was freed meanwhile.
"""

import datetime
import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.kv_transfer.block_io import BlockLayout
from engine.kv_transfer.connector import KVConnector, TransferResult

logger = logging.getLogger(__name__)

# How often the receiver looks for the next header while a transfer is outstanding (store.check: no blocking
# wait in the store, whose timeouts log a warning each); with none outstanding it sleeps until one is.
STORE_POLL_S = 0.005


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return (host, int(port)) if host else (address, 0)


@dataclass(slots=True)
class _Load:
    block_ids: list[int]
    started: float
    arrived: int = 0  # blocks written so far
    num_bytes: int = 0
    pieces: int = 0


@dataclass(slots=True)
class _Arrival:
    pair_id: str
    transfer_id: int
    payload: torch.Tensor | None
    error: str | None  # set: the transfer ended without (the rest of) its blocks
    num_blocks: int = 0
    first: int = 0
    last: bool = True


class P2PConnector(KVConnector):
    """``KVConnector`` on torch.distributed: see the module docstring. ``role``: "decode" hosts the store."""

    def __init__(self, layout: BlockLayout, role: str, address: str | None, timeout_s: float) -> None:
        self.layout = layout
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.address = None
        self._store = None
        if role == "decode":
            host, port = _host_port(address or "127.0.0.1")
            self._store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=self.timeout)
            self.address = f"{host}:{self._store.port}"
        self._pairs: dict[str, "_Pair"] = {}
        self._loads: dict[tuple[str, int], _Load] = {}
        self._events: queue.SimpleQueue = queue.SimpleQueue()  # _Arrival and TransferResult, from the pairs' threads
        # Loads whose data has not arrived, given up on or not (a given-up one's data must still be drained).
        self._outstanding: set[tuple[str, int]] = set()
        self._expecting = threading.Event()  # set while _outstanding is not empty
        self._closed = threading.Event()

    def pair(self, pair_id: str, rank: int, address: str) -> None:
        if pair_id in self._pairs:
            return
        p = _Pair(self, pair_id, rank, address)
        self._pairs[pair_id] = p
        p.thread.start()

    def save_blocks(self, pair_id: str, transfer_id: int, block_ids: list[int] | None, first: int = 0,
                    last: bool = True) -> None:
        # A copy: the blocks may be reused now. uint8 [len(block_ids), bytes_per_block]; None: the blocks are gone.
        payload = self.layout.gather(block_ids) if block_ids else None
        num_blocks = -1 if block_ids is None else len(block_ids)
        p = self._pairs.get(pair_id)
        if p is None:
            if last or block_ids is None:
                self._events.put(TransferResult(pair_id, transfer_id, True, False, error="unknown pair"))
            return
        p.outbox.put(_Piece(transfer_id, first, num_blocks, last or block_ids is None, payload, time.monotonic()))

    def load_blocks(self, pair_id: str, transfer_id: int, block_ids: list[int]) -> None:
        self._loads[pair_id, transfer_id] = _Load(block_ids, time.monotonic())
        self._outstanding.add((pair_id, transfer_id))
        self._expecting.set()
        if pair_id not in self._pairs:
            self._events.put(_Arrival(pair_id, transfer_id, None, "unknown pair"))

    def abort(self, pair_id: str, transfer_id: int) -> None:
        self._loads.pop((pair_id, transfer_id), None)

    def done(self) -> list[TransferResult]:
        results: list[TransferResult] = []
        now = time.monotonic()
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            if isinstance(event, TransferResult):
                results.append(event)
                continue
            if event.transfer_id < 0:  # the pair failed: every load it owed fails
                keys = [k for k in self._loads if k[0] == event.pair_id]
                self._outstanding -= {k for k in self._outstanding if k[0] == event.pair_id}
            else:
                keys = [(event.pair_id, event.transfer_id)]
                if event.last:
                    self._outstanding.discard(keys[0])
            for key in keys:
                load = self._loads.get(key)
                if load is None:
                    continue  # given up on (aborted, timed out): the data was drained, nothing to write
                if event.error is None and event.first != load.arrived:
                    event.error = f"blocks from {event.first} arrived after {load.arrived}"
                if event.error is None and load.arrived + event.num_blocks > len(load.block_ids):
                    event.error = f"{load.arrived + event.num_blocks} blocks arrived for {len(load.block_ids)} asked"
                if event.error is None and event.last and load.arrived + event.num_blocks != len(load.block_ids):
                    event.error = f"{load.arrived + event.num_blocks} blocks arrived for {len(load.block_ids)} asked"
                if event.error is not None:
                    del self._loads[key]
                    results.append(TransferResult(key[0], key[1], False, False, error=event.error))
                    continue
                if event.num_blocks:
                    self.layout.scatter(load.block_ids[load.arrived:load.arrived + event.num_blocks], event.payload)
                    load.arrived += event.num_blocks
                    load.num_bytes += event.payload.numel()
                    load.pieces += 1
                if event.last:
                    del self._loads[key]
                    results.append(TransferResult(key[0], key[1], False, True, load.num_bytes, now - load.started,
                                                  pieces=load.pieces))
        for key, load in list(self._loads.items()):
            if now - load.started > self.timeout_s:
                del self._loads[key]
                results.append(TransferResult(key[0], key[1], False, False,
                                              error=f"timed out after {self.timeout_s:g} s"))
        if not self._outstanding:
            self._expecting.clear()
        return results

    @property
    def pending(self) -> bool:
        return bool(self._loads)

    def close(self) -> None:
        """End every pair's group (a gloo group left to the interpreter's exit aborts the process)."""
        self._closed.set()
        for p in self._pairs.values():
            if p.group is not None:
                try:
                    p.group.shutdown()
                except Exception as e:  # a peer already gone: nothing left to end cleanly
                    logger.debug("KV pair %s: shutdown: %s", p.pair_id, e)


@dataclass(slots=True)
class _Piece:
    """Blocks ``first .. first + num_blocks - 1`` of a transfer, on their way out (num_blocks -1: gone)."""

    transfer_id: int
    first: int
    num_blocks: int
    last: bool
    payload: torch.Tensor | None  # uint8 [num_blocks, bytes_per_block]
    queued: float


class _Pair:
    """One pair's group and the thread that sends (prefill side) or receives (decode side) on it."""

    def __init__(self, connector: P2PConnector, pair_id: str, rank: int, address: str) -> None:
        self.connector = connector
        self.pair_id = pair_id
        self.rank = rank
        self.address = address
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.group = None  # once formed
        self.thread = threading.Thread(target=self._run, name=f"moegate-kv-{pair_id}", daemon=True)

    def _group(self):
        c = self.connector
        if self.rank == 0:
            store = c._store
        else:
            host, port = _host_port(self.address)
            store = dist.TCPStore(host, port, is_master=False, timeout=c.timeout)
        prefixed = dist.PrefixStore(f"kv/{self.pair_id}/", store)
        if c.layout.device.type == "cuda":
            group = dist.ProcessGroupNCCL(prefixed, self.rank, 2, dist.ProcessGroupNCCL.Options())
        else:
            group = dist.ProcessGroupGloo(prefixed, self.rank, 2, c.timeout)
        return prefixed, group

    def _run(self) -> None:
        c = self.connector
        try:
            store, group = self._group()
            self.group = group
        except Exception as e:
            logger.error("KV pair %s could not form: %s", self.pair_id, e)
            self._fail(f"the pair could not form: {e}")
            return
        logger.info("KV pair %s formed (rank %d, %s)", self.pair_id, self.rank, self.address)
        try:
            (self._send_loop if self.rank == 1 else self._receive_loop)(store, group)
        except Exception as e:  # the peer died or a transfer timed out: the pair is done
            logger.error("KV pair %s failed: %s", self.pair_id, e)
            self._fail(str(e))

    def _fail(self, error: str) -> None:
        c = self.connector
        if self.rank == 0:
            c._events.put(_Arrival(self.pair_id, -1, None, f"KV pair {self.pair_id}: {error}"))
            return
        while True:  # sends queued or still to come fail at once
            try:
                piece = self.outbox.get(timeout=None if not c._closed.is_set() else 0)
            except queue.Empty:
                return
            if piece.last:
                c._events.put(TransferResult(self.pair_id, piece.transfer_id, True, False, error=error))

    def _send_loop(self, store, group) -> None:
        c = self.connector
        seq = 0
        sending: dict[int, list] = {}  # transfer id -> [bytes sent, pieces, when its first piece was queued]
        while True:
            piece = self.outbox.get()
            store.set(f"seq/{seq}", f"{piece.transfer_id} {piece.first} {piece.num_blocks} {int(piece.last)}")
            seq += 1
            sent = sending.setdefault(piece.transfer_id, [0, 0, piece.queued])
            if piece.payload is not None:
                group.send([piece.payload], 0, 0).wait(c.timeout)
                sent[0] += piece.payload.numel()
                sent[1] += 1
            if not piece.last:
                continue
            del sending[piece.transfer_id]
            if piece.num_blocks >= 0:
                logger.info("KV transfer %s/%d sent: %d bytes in %d pieces, %.3f s from the first", self.pair_id,
                            piece.transfer_id, sent[0], sent[1], time.monotonic() - sent[2])
                c._events.put(TransferResult(self.pair_id, piece.transfer_id, True, True, sent[0],
                                             time.monotonic() - sent[2], pieces=sent[1]))
            else:
                logger.warning("KV transfer %s/%d: the blocks were gone; the decode engine prefills itself",
                               self.pair_id, piece.transfer_id)
                c._events.put(TransferResult(self.pair_id, piece.transfer_id, True, False, error="blocks gone"))

    def _receive_loop(self, store, group) -> None:
        c = self.connector
        seq = 0
        while not c._closed.is_set():
            key = f"seq/{seq}"
            if not c._expecting.wait(1.0):
                continue
            if not store.check([key]):
                time.sleep(STORE_POLL_S)
                continue
            transfer_id, first, n, last = (int(x) for x in store.get(key).decode().split())
            store.delete_key(key)
            seq += 1
            if n < 0:
                c._events.put(_Arrival(self.pair_id, transfer_id, None, "the prefill engine no longer held the blocks"))
                continue
            payload = None
            if n:
                payload = torch.empty((n, c.layout.bytes_per_block), dtype=torch.uint8, device=c.layout.device)
                group.recv([payload], 1, 0).wait(c.timeout)
            c._events.put(_Arrival(self.pair_id, transfer_id, payload, None, n, first, bool(last)))
