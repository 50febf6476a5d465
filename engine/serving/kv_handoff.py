"""A prefill or decode engine process's side of handing a prompt's KV over, in the engine process.

Decode side: a request that comes with a ``KVSource`` is parked before the scheduler sees it. Its prompt's full
blocks (all but the last token's, which the engine computes itself for its logits) are hashed as the prefix
cache hashes them (chained, salted by tenant); the blocks already cached here are taken, blocks for the rest
are allocated, and the engine answers with the hashes it lacks. A model with a sliding-window cache group
(gpt-oss) asks for that group's blocks too, under the group's prefix-cache keys, but only those in the window
of the prompt's last token: what admission looks up. When they arrive the new blocks are registered
in the prefix cache under those hashes and released, and the request joins the scheduler like any other: its
admission finds the whole prefix cached and computes only the last, partial block. Its outputs report as cached
prompt tokens only what this engine's prefix cache held before the transfer (``usage``'s ``cached_tokens``
means prefix-cache hits, not KV that was computed for this request elsewhere). If the transfer fails or
times out the request joins the same way without the blocks and its prompt is computed here. Too few missing
tokens (``EngineConfig.local_prefill_tokens``), or too few free blocks: no transfer at all.

Prefill side: a request with a ``KVSink`` runs as usual (the gateway asks for one token). After every step the
sink's blocks that have become computed (registered in the prefix cache under the sink's hashes, in order) are
copied out and sent as one piece (``KVConnector.save_blocks``): a prompt longer than one chunk of the chunked
prefill sends each chunk's blocks while the next chunk computes, and when the request finishes only the rest
goes. Each piece is a copy, so no block is held or reused while it travels. A sink request that ends otherwise
(aborted, failed, its blocks evicted) tells the decode engine the blocks are gone: it prefills itself.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass

from engine.core.block_pool import Block, hash_block_tokens
from engine.core.config import EngineConfig
from engine.core.kv_cache_manager import first_live_block, group_key
from engine.core.outputs import RequestOutput
from engine.core.stats import SchedulerStats
from engine.kv_transfer.block_io import BlockLayout
from engine.kv_transfer.connector import KVConnector
from engine.kv_transfer.p2p import P2PConnector
from engine.serving.protocol import AddRequest, KVSink, PairKV

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Sending:
    sink: KVSink
    sent: int = 0  # of sink.block_hashes, the leading ones sent so far


@dataclass(slots=True)
class _Parked:
    msg: AddRequest
    hits: list[Block]  # cached here already: held so they stay while the rest arrives
    new_blocks: list[Block]  # what the transfer fills
    hashes: list[bytes]  # of new_blocks
    cached_tokens: int  # the prompt's leading tokens whose blocks this engine's prefix cache already held


class KVHandoff:
    """The engine process's part of disaggregated serving (see the module docstring)."""

    def __init__(self, engine, config: EngineConfig, connector: KVConnector | None = None) -> None:
        self.engine = engine
        self.role = config.role
        self.block_size = config.block_size
        self.local_prefill_tokens = config.local_prefill_tokens
        self.connector = connector or P2PConnector(BlockLayout(engine.runner.kv_caches), config.role,
                                                   config.kv_transfer_address, config.kv_transfer_timeout_s)
        self._parked: dict[str, _Parked] = {}
        self._by_transfer: dict[tuple[str, int], str] = {}  # (pair, transfer) -> parked request id
        self._sinks: dict[str, _Sending] = {}
        # Requests running on transferred KV -> the prompt tokens they may report as cached (prefix-cache hits).
        self._cached_tokens: dict[str, int] = {}
        self.transfers = self.bytes = self.fallbacks = self.pieces = 0
        self.seconds = 0.0

    @property
    def address(self) -> str | None:
        return self.connector.address

    def pair(self, msg: PairKV) -> None:
        self.connector.pair(msg.pair_id, msg.rank, msg.address)

    # ---- decode side ------------------------------------------------------
    def park(self, msg: AddRequest) -> list[bytes]:
        """Park a request whose prompt KV comes from elsewhere; the hashes of the blocks wanted (empty: not
        parked, the caller adds it as usual)."""
        pool = self.engine.scheduler.kv.pool
        try:
            prompt = self.engine.prepare_prompt(msg.prompt)
        except ValueError:
            return []  # the caller's add rejects it with the reason
        if msg.sampling_params.prompt_logprobs is not None or msg.request_id in self._parked:
            return []  # prompt logprobs need every prompt position computed here
        bs = self.block_size
        hashes: list[bytes] = []
        for i in range((len(prompt) - 1) // bs):  # the last token is always computed here, for its logits
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, prompt[i * bs:(i + 1) * bs],
                                            msg.policy.cache_salt, msg.policy.lora_adapter))
        hits: list[Block] = []
        missing: list[bytes] = []
        positions: set[int] = set()  # of the blocks missing in some group: the tokens a transfer saves computing
        for i, key in self._wanted(hashes):
            block = pool.lookup(key)
            if block is None:
                missing.append(key)
                positions.add(i)
            else:
                hits.append(block)
        revived = sum(1 for b in hits if b.ref_count == 0)
        if len(positions) * bs < max(self.local_prefill_tokens, 1) or len(missing) + revived > pool.num_free_blocks:
            return []
        pool.acquire(hits, msg.policy.priority)
        new_blocks = pool.allocate(len(missing))
        source = msg.kv_source
        self._parked[msg.request_id] = _Parked(msg, hits, new_blocks, missing, min(positions) * bs)
        self._by_transfer[source.pair_id, source.transfer_id] = msg.request_id
        self.connector.load_blocks(source.pair_id, source.transfer_id, [b.block_id for b in new_blocks])
        return missing

    def _wanted(self, hashes: list[bytes]) -> list[tuple[int, bytes]]:
        """The block positions and prefix-cache keys of the blocks admission needs for a prefix of these full blocks, by position (a
        position's full-group block, then its sliding groups'): every block of the full group, a sliding group's
        only within the window of the first token left to compute (``KVCacheManager.find_cached_prefix``). The
        prefill engine sends them in this order, so each chunk's blocks leave as it computes them."""
        kv = self.engine.scheduler.kv
        n = len(hashes)
        firsts = [first_live_block(n * self.block_size, w, self.block_size) for w in kv.windows]
        return [(i, group_key(h, g)) for i, h in enumerate(hashes) for g, first in enumerate(firsts) if i >= first]

    def poll(self, add: Callable[[AddRequest], None]) -> bool:
        """Apply the transfers that ended; True if any request joined the scheduler."""
        changed = False
        for result in self.connector.done():
            if result.sent:
                self._count(result)
                continue
            request_id = self._by_transfer.pop((result.pair_id, result.transfer_id), None)
            parked = self._parked.pop(request_id, None) if request_id is not None else None
            if parked is None:
                continue
            pool = self.engine.scheduler.kv.pool
            if result.ok:
                for block, h in zip(parked.new_blocks, parked.hashes):
                    pool.register(block, h, parked.msg.policy.tenant, parked.msg.policy.priority)
                self._count(result)
                self._cached_tokens[request_id] = parked.cached_tokens
            else:
                self.fallbacks += 1
                logger.warning("KV transfer %s/%d for request %s failed (%s): prefilling it here", result.pair_id,
                               result.transfer_id, request_id, result.error)
            pool.release(list(reversed(parked.hits + parked.new_blocks)))
            add(parked.msg)
            changed = True
        return changed

    def source_lost(self, request_id: str, add: Callable[[AddRequest], None]) -> None:
        """Its prefill engine is gone: stop waiting and prefill the request here."""
        parked = self._unpark(request_id)
        if parked is not None:
            self.fallbacks += 1
            logger.warning("request %s: its prefill engine is gone; prefilling it here", request_id)
            add(parked.msg)

    def abort(self, request_id: str) -> bool:
        """Drop a parked request (True) and free its blocks: the connector drops its data if it still comes. A
        sink request (prefill side): its decode engine is told the blocks will not come (False: the caller
        aborts the request in the engine)."""
        self._cached_tokens.pop(request_id, None)
        sending = self._sinks.pop(request_id, None)
        if sending is not None:
            self.connector.save_blocks(sending.sink.pair_id, sending.sink.transfer_id, None)
        return self._unpark(request_id) is not None

    def _unpark(self, request_id: str) -> _Parked | None:
        parked = self._parked.pop(request_id, None)
        if parked is None:
            return None
        source = parked.msg.kv_source
        self._by_transfer.pop((source.pair_id, source.transfer_id), None)
        self.connector.abort(source.pair_id, source.transfer_id)
        self.engine.scheduler.kv.pool.release(list(reversed(parked.hits + parked.new_blocks)))
        return parked

    @property
    def pending(self) -> bool:
        """Whether the engine loop must keep polling (transfers awaited or being sent)."""
        return bool(self._parked)

    # ---- prefill side -----------------------------------------------------
    def expect_sink(self, msg: AddRequest) -> None:
        self._sinks[msg.request_id] = _Sending(msg.kv_sink)

    def after_step(self, outputs: list[RequestOutput]) -> None:
        """Decode side: outputs of requests on transferred KV count only prefix-cache hits as cached. Prefill
        side: send each sink request's blocks computed since the last piece; a request that finished this step
        sends the rest and ends its transfer (its blocks are still cached: nothing was allocated since)."""
        if self._cached_tokens:
            self._count_cached(outputs)
        if not self._sinks:
            return
        pool = self.engine.scheduler.kv.pool
        finished = {out.request_id: out for out in outputs if out.finished}
        for request_id, sending in list(self._sinks.items()):
            sink, out = sending.sink, finished.get(request_id)
            if out is not None and out.finish_reason not in ("length", "stop"):
                del self._sinks[request_id]
                self.connector.save_blocks(sink.pair_id, sink.transfer_id, None)
                continue
            ready: list[int] = []  # block ids of the next computed blocks, in order
            for h in sink.block_hashes[sending.sent:]:
                block = pool.lookup(h)
                if block is None:
                    break
                ready.append(block.block_id)
            if out is None:  # still computing: send what is ready, the rest follows
                if ready:
                    self.connector.save_blocks(sink.pair_id, sink.transfer_id, ready, sending.sent, last=False)
                    sending.sent += len(ready)
                continue
            del self._sinks[request_id]
            if sending.sent + len(ready) < len(sink.block_hashes):  # evicted before it finished: they are gone
                self.connector.save_blocks(sink.pair_id, sink.transfer_id, None)
                continue
            self.connector.save_blocks(sink.pair_id, sink.transfer_id, ready, sending.sent, last=True)

    def _count_cached(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            cached = self._cached_tokens.get(out.request_id)
            if cached is None:
                continue
            out.num_cached_tokens = min(out.num_cached_tokens, cached)
            if out.finished and out.request_id not in self.engine.choice_groups:  # its last choice (n > 1) ended
                del self._cached_tokens[out.request_id]

    def _count(self, result) -> None:
        if result.ok:
            self.transfers += 1
            self.bytes += result.num_bytes
            self.seconds += result.seconds
            self.pieces += result.pieces
        else:
            logger.warning("KV transfer %s/%d not sent: %s", result.pair_id, result.transfer_id, result.error)

    def close(self) -> None:
        self.connector.close()

    def fill(self, stats: SchedulerStats) -> SchedulerStats:
        stats.kv_transfers, stats.kv_transfer_bytes = self.transfers, self.bytes
        stats.kv_transfer_seconds, stats.kv_transfer_fallbacks = self.seconds, self.fallbacks
        stats.kv_transfer_pieces = self.pieces
        return stats
