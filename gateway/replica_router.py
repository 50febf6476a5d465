"""Several engine replicas behind one ``EngineClient``: the routes, the Batch API and metrics see one engine.

Each request goes to one replica, chosen by ``gateway.routing_policy`` from
the prompt's tenant-salted block hashes (``gateway.prefix_index``; a block
holding an image's placeholder tokens keyed by that image too, as the engine
keys it) and each replica's load. Priorities, quotas and fairness stay where they are: admission
in the gateway, priority classes and weighted shares in each replica's scheduler.
With ``RouterConfig.fleet_fairness`` the weighted shares hold over the whole
fleet instead: requests wait in the router's weighted-fair queue
(``gateway.fleet_fairness``) until a replica has room, and the tenant owed the
most service across every replica goes next, to the replica with room that the
routing policy prefers.

Faults: a replica whose process died (or whose connection dropped) has
``dead`` set by its reader at once and is skipped from the next request on. A
request it was holding that had produced no output yet is sent to another
live replica, so a client never sees that replica's death; a stream that had
started ends with the engine's error (the gateway writes a clean error
event). A failed *step* (``EngineError.retryable`` False) is not retried
elsewhere: the request may be its cause. Each replica is restarted on its own
by the gateway's supervisor, and rejoins with an empty index when it is ready.

Moves: each request is routed once, but a replica with a free slot (a request
there ended, or it joined idle: the router looks whenever a request ends and
every ``RouterConfig.rebalance_interval_s`` while requests wait unstarted)
while another live replica's load exceeds its slots takes a request from that
queue (``gateway.routing_policy.rebalance``): the most
recently routed request there that has produced no output, which under the
engines' first-come order is the last to start. The router asks that engine
to release it (``EngineClient.release``): the engine drops it only if it has
not started (still waiting, nothing computed or generated), since a request
without output may be running (a ``stream=False`` one shows nothing until it
ends; a newer request of a more urgent class starts before older ones). Released,
it is sent to the replica with the free slot with the same request id,
``SamplingParams`` and ``RequestPolicy``; refused, it
stays and is not asked again. Until its first output arrives, ``generate``
waits on that output and on a move at once, so the client never sees a move;
a request that has produced any output never moves. ``moved_from`` counts
the moves off each replica.

Scaling (``gateway.replica_scaling``): a replica can join while the router serves (``add_replica``, once it is
ready) and leave (``drain``: it takes no new request from then on, and is dropped by ``remove`` once the
requests it holds have ended). A left replica's slot (its index) is reused by the next one to join, so the
indices that requests and moves hold stay valid.
"""

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Sequence

from engine.core.config import EngineConfig
from engine.core.outputs import RequestOutput
from engine.core.request_policy import DEFAULT_POLICY, RequestPolicy
from engine.core.sampling_params import SamplingParams
from engine.core.stats import SchedulerStats
from engine.serving.async_engine import EngineError
from gateway.disaggregation import DisaggregatedEngines
from gateway.fleet_fairness import FairGate, Ticket
from engine.serving.client import CheckedBeforeStart, EngineClient
from engine.serving.protocol import Ready
from gateway.chat_images import image_model_of
from gateway.prefix_index import ReplicaBlocks, RoutedImage, block_hashes, remembered_blocks, routed_images
from gateway.routing_policy import ReplicaView, RouterConfig, choose, rebalance

logger = logging.getLogger(__name__)


class ReplicaRouter:
    """An ``EngineClient`` over ``replicas`` (named by ``names``, the ``replica`` label of metrics and /health)."""

    def __init__(self, replicas: Sequence[EngineClient], names: Sequence[str], config: RouterConfig | None = None) -> None:
        if not replicas or len(replicas) != len(names) or len(set(names)) != len(names):
            raise ValueError("a router needs at least one replica and one distinct name for each")
        self.replicas = list(replicas)
        self.names = list(names)
        self.policy = config or RouterConfig()
        self.config: EngineConfig = self.replicas[0].config
        self.block_size = self.config.block_size
        self._index = [ReplicaBlocks(r.config.num_kv_blocks) for r in self.replicas]
        self.in_flight = [0] * len(self.replicas)  # requests this router sent to each and that have not ended
        self.routed = [0] * len(self.replicas)  # requests sent to each, ever (tests and benchmarks read it)
        self._turn = itertools.count()
        self._ids = itertools.count()
        self._ready: list[Ready | None] = [None] * len(self.replicas)  # each one's Ready when last routed to
        self.moved_from = [0] * len(self.replicas)  # requests moved off each one's queue, ever (metrics)
        # Per replica, its requests that have produced no output yet, oldest routed first (dicts keep order).
        self._unstarted: list[dict[_Placement, None]] = [{} for _ in self.replicas]
        # Per replica, requests moved off it while its latest stats were current: those stats still count
        # them, and a second move on such stale figures could take a request that was running.
        self._moved_off: list[tuple[SchedulerStats | None, int]] = [(None, 0)] * len(self.replicas)
        # Per replica, moves off it (``_leaving``) and onto it (``_arriving``) whose release is not yet answered.
        self._leaving = [0] * len(self.replicas)
        self._arriving = [0] * len(self.replicas)
        self._moves: set[asyncio.Task] = set()
        self._watch: asyncio.Task | None = None  # looks for moves every rebalance_interval_s while requests wait
        # Per replica, the LoRA adapters of the requests sent there, most recent last, as many as it keeps resident
        # (max_loras): the router's guess at which adapters each has loaded (``ReplicaView.has_adapter``).
        self._adapters: list[dict[str, None]] = [{} for _ in self.replicas]
        # Per replica, the requests that count there now (their policies: which a more urgent request may preempt).
        self._placed: list[dict[_Placement, None]] = [{} for _ in self.replicas]
        # The fleet's weighted-fair queue (RouterConfig.fleet_fairness), else None: each replica's scheduler alone.
        # Its starvation bound is the engines' (EngineConfig.starvation_bound_s where the engine has one).
        self.gate: FairGate[int] | None = FairGate(
            self._place_fair, self._unplace, getattr(self.config, "starvation_bound_s", None),
        ) if self.policy.fleet_fairness else None
        # Per slot: SERVING (takes requests), DRAINING (leaving: finishes what it holds, takes nothing new) or
        # REMOVED (gone; its slot is free for the next replica to join).
        self.states = [SERVING] * len(self.replicas)

    def current(self) -> list[int]:
        """The slots of the replicas that are part of the fleet now (serving or draining), in slot order."""
        return [i for i, state in enumerate(self.states) if state != REMOVED]

    def _members(self) -> list[EngineClient]:
        return [self.replicas[i] for i in self.current()]

    def add_replica(self, replica: EngineClient, name: str) -> int:
        """Make a started (ready) replica take requests from now on; its slot index. A free slot is reused."""
        if name in (self.names[i] for i in self.current()):
            raise ValueError(f"a replica named {name!r} serves already")
        i = self.states.index(REMOVED) if REMOVED in self.states else len(self.replicas)
        fresh = {"_index": ReplicaBlocks(replica.config.num_kv_blocks), "in_flight": 0, "routed": 0, "_ready": None,
                 "moved_from": 0, "_unstarted": {}, "_moved_off": (None, 0), "_leaving": 0, "_arriving": 0,
                 "_adapters": {}, "_placed": {}}
        if i == len(self.replicas):
            self.replicas.append(replica)
            self.names.append(name)
            self.states.append(SERVING)
            for field, value in fresh.items():
                getattr(self, field).append(value)
        else:
            self.replicas[i], self.names[i], self.states[i] = replica, name, SERVING
            for field, value in fresh.items():
                getattr(self, field)[i] = value
        if self.gate is not None:
            self.gate.pump()  # requests waiting in the fair queue may go there now
        self._rebalance()  # requests queued at busy replicas may move there now
        return i

    def drain(self, i: int) -> None:
        """Replica ``i`` takes no new request from now on (nor moved ones); what it holds runs to its end."""
        if self.states[i] != SERVING:
            raise ValueError(f"replica {self.names[i]} is not serving")
        if len([s for s in self.states if s == SERVING]) == 1:
            raise ValueError("the last serving replica cannot leave")
        self.states[i] = DRAINING

    def remove(self, i: int) -> None:
        """Forget draining replica ``i`` (stopped by its owner); its slot is free for the next one to join."""
        if self.states[i] != DRAINING:
            raise ValueError(f"replica {self.names[i]} is not draining")
        self.states[i] = REMOVED

    # -- EngineClient state: one engine as long as one replica serves --

    @property
    def info(self) -> Ready | None:
        """The first ready replica's (every replica serves the same model)."""
        return next((r.info for r in self._members() if r.info is not None and not r.dead), None)

    @property
    def dead(self) -> str | None:
        """None while any replica runs or starts; once all are down, that they are (for clients: no names)."""
        return None if any(r.dead is None for r in self._members()) else "every engine replica is down"

    @property
    def dead_detail(self) -> str | None:
        """``dead`` with each replica's name and what its engine reported, for the log."""
        if self.dead is None:
            return None
        return f"{self.dead} (" + "; ".join(
            f"{self.names[i]}: {self.replicas[i].dead_detail or self.replicas[i].dead}" for i in self.current()) + ")"

    @property
    def stats(self) -> SchedulerStats | None:
        """The replicas' statistics summed (per-replica figures are in ``replicas``' own ``stats``)."""
        reports = [r.stats for r in self._members() if r.stats is not None]
        if not reports:
            return None
        waiting: dict[int, int] = {}
        for s in reports:
            for priority, n in s.num_waiting_by_priority.items():
                waiting[priority] = waiting.get(priority, 0) + n
        total = {f: sum(getattr(s, f) for s in reports) for f in _SUMMED}
        return SchedulerStats(num_waiting_by_priority=waiting, **total)

    # -- lifecycle --

    async def start(self) -> Ready:
        """Check every replica that has something to check (``CheckedBeforeStart``: a remote engine's place),
        then start them all at once; as soon as one fails, the others are stopped (replicas of one expert group
        would otherwise wait for the failed one at their rendezvous for minutes) and its error raised."""
        if checks := [r.preflight() for r in self.replicas if isinstance(r, CheckedBeforeStart)]:
            await self._all_or_none(checks)
        return (await self._all_or_none([r.start() for r in self.replicas]))[0]

    async def _all_or_none(self, steps: list) -> list:
        """Run one step (a check, a start) on every replica at once; their results, or, as soon as one fails or
        the gateway stops, the others cancelled (each replica then ends its engine or closes its connection at
        once), every replica shut down and the error raised."""
        tasks = [asyncio.ensure_future(step) for step in steps]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = next((t.exception() for t in tasks if t.done() and t.exception() is not None), None)
            if failed is not None:
                raise failed
            return [t.result() for t in tasks]
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.shutdown()
            raise

    async def restart(self) -> Ready:
        """Restart the replicas that are down (the gateway's supervisor restarts each on its own instead)."""
        for replica in self._members():
            if replica.dead:
                await replica.restart()
        return self.info

    async def shutdown(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await asyncio.gather(*(r.shutdown() for r in self._members()), return_exceptions=True)

    async def prepare(self, prompt: str | list[int] | None = None, messages: Sequence | None = None,
                      add_generation_prompt: bool = True) -> list[int]:
        """Prompt preparation runs in this process; any replica's tokenizer does (they are the same)."""
        return await self._any().prepare(prompt, messages, add_generation_prompt)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        return await self._any().detokenize(token_ids)

    def _any(self) -> EngineClient:
        members = self._members()
        ready = [r for r in members if not r.dead and r.info is not None]
        return (ready or members)[0]

    def silent_s(self) -> float:
        return min(r.silent_s() for r in self._members())

    def chat_template(self) -> str | None:
        return self._any().chat_template()  # the replicas serve the same checkpoint

    # -- routing --

    def responsive(self, i: int) -> bool:
        """Whether replica ``i`` has spoken within ``RouterConfig.unresponsive_after_s``."""
        return self.replicas[i].silent_s() < self.policy.unresponsive_after_s

    def live(self) -> list[int]:
        """Replicas that may take a request now: ready, not down, and responsive unless none is (a request then
        waits on a silent replica rather than failing at once)."""
        out = []
        for i, r in enumerate(self.replicas):
            if self.states[i] != SERVING or r.dead is not None or r.info is None:
                continue
            if r.info is not self._ready[i]:  # started (or restarted) since we last looked: an empty cache
                self._index[i].clear()
                self._adapters[i].clear()
                self._ready[i] = r.info
            out.append(i)
        return [i for i in out if self.responsive(i)] or out

    def pick(self, hashes: Sequence[bytes], exclude: set[int] = frozenset(), adapter: str | None = None) -> int:
        """The replica for a prompt with these block hashes (under LoRA ``adapter``); EngineError if none is live."""
        live = [i for i in self.live() if i not in exclude]
        if not live:
            raise EngineError(self.dead or "no engine replica is ready")
        return choose(self.policy, self._views(live, hashes, adapter), next(self._turn))

    def _views(self, live: Sequence[int], hashes: Sequence[bytes], adapter: str | None = None) -> list[ReplicaView]:
        views = []
        for i in live:
            stats = self.replicas[i].stats
            index = self._index[i]
            load, kv = self.in_flight[i], 0.0
            if stats is not None:
                reported = stats.num_running + sum(stats.num_waiting_by_priority.values())
                moved_stats, moved = self._moved_off[i]
                load = max(load, reported - (moved if moved_stats is stats else 0))
                kv = stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
                index.capacity = remembered_blocks(stats)
            load += self._arriving[i] - self._leaving[i]
            views.append(ReplicaView(i, load, self.replicas[i].config.max_num_seqs, kv, index.matched(hashes), index.roots,
                                     adapter is not None and adapter in self._adapters[i]))
        return views

    def matched_blocks(self, prompt: Sequence[int], cache_salt: str | None,
                       images: Sequence[bytes] = ()) -> list[int]:
        """Per replica, how many of the prompt's leading blocks (with ``images``, as ``generate`` takes them) the
        index believes it holds."""
        hashes = block_hashes(prompt, self.block_size, cache_salt, images=self._routed_images(prompt, images))
        return [index.matched(hashes) for index in self._index]

    def _routed_images(self, prompt: Sequence[int], images: Sequence[bytes]) -> tuple[RoutedImage, ...]:
        if not images:
            return ()
        model = image_model_of(self)
        return routed_images(prompt, model.image_token_id if model is not None else None, images)

    async def generate(self, prompt: list[int], sampling_params: SamplingParams, request_id: str | None = None,
                       policy: RequestPolicy = DEFAULT_POLICY, stream: bool = True,
                       images: Sequence[bytes] = ()) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs from the replica chosen for it; see the module's docstring for
        faults and moves. ``images`` go with the request to whichever replica runs it."""
        request_id = request_id or f"req-{next(self._ids)}"
        hashes = block_hashes(prompt, self.block_size, policy.cache_salt, policy.lora_adapter,
                              self._routed_images(prompt, images))
        placement = _Placement(request_id, hashes, policy.lora_adapter, policy)
        tried: set[int] = set()  # replicas that failed this request before it started
        ticket: Ticket[int] | None = None
        if self.gate is None:
            self._assign(placement, self.pick(hashes, adapter=placement.adapter))
            self._watch_queues()
        else:
            self._watch_queues()  # a replica that joins while requests wait here takes them
            most = None if sampling_params.max_tokens is None else sampling_params.max_tokens * sampling_params.n
            ticket, _ = await self.gate.enter(policy, len(prompt), most, placement)  # assigned by _place_fair
        try:
            while True:
                i = placement.replica
                extra = {"images": images} if images else {}
                outputs = self.replicas[i].generate(prompt, sampling_params, request_id, policy, stream, **extra)
                started = False
                try:
                    first = await self._first_output(outputs, placement)
                    if first is _MOVED:
                        continue  # placement.replica is the new one; closing the stream aborts it here
                    self._unstarted[i].pop(placement, None)
                    if first is _ENDED:
                        return
                    started = True
                    if ticket is not None:
                        self.gate.charge(ticket, first)
                    yield first
                    async for out in outputs:
                        if ticket is not None:
                            self.gate.charge(ticket, out)
                        yield out
                    return
                except EngineError as e:
                    if started or not e.retryable:
                        raise
                    logger.warning("replica %s failed before request %s started (%s); sending it to another",
                                   self.names[i], request_id, e.detail)
                    tried.add(i)
                    self._release(placement)
                    self._assign(placement, self.pick(hashes, tried, placement.adapter))
                finally:
                    await outputs.aclose()  # aborts the request in that replica if it has not finished
        finally:
            self._release(placement)
            if ticket is not None:
                self.gate.leave(ticket)  # the freed slot goes to the next request in fair order
            self._rebalance()  # a slot may have freed here

    async def release(self, request_id: str) -> bool:
        """Always False: the router moves the requests sent through it itself (see the module's docstring)."""
        return False

    async def _first_output(self, stream: AsyncIterator[RequestOutput], placement: "_Placement"):
        """The stream's first output, ``_ENDED`` if it ended without one, or ``_MOVED`` if the router moved
        the request first (a move wins a tie: its bookkeeping is done, and the client has seen nothing)."""
        placement.moved.clear()
        output = asyncio.ensure_future(anext(stream, _ENDED))
        moved = asyncio.ensure_future(placement.moved.wait())
        try:
            await asyncio.wait((output, moved), return_when=asyncio.FIRST_COMPLETED)
        finally:
            moved.cancel()
            if not output.done() or placement.moved.is_set():
                output.cancel()  # the stream must be idle before it is closed
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await output
        if placement.moved.is_set():
            return _MOVED
        return output.result()

    def _place_fair(self, ticket: Ticket[int]) -> int | None:
        """The fair queue's ``place``: the replica for this request if one has room for it (a free slot; for a
        request that may preempt, else a replica running more preemptible requests of less urgent classes than it
        has requests beyond its slots, so that each one sent past its slots displaces one), assigned there; None if
        none has. Among those with room, the routing policy chooses (affinity, then load)."""
        placement: _Placement = ticket.payload
        live = self.live()
        if not live:
            raise EngineError(self.dead or "no engine replica is ready")
        views = self._views(live, ())
        room = {v.index for v in views if v.load < v.slots}
        if not room and ticket.policy.may_preempt:
            room = {v.index for v in views if v.load - v.slots < self._victims(v.index, ticket.policy.priority)}
        if not room:
            return None
        i = self.pick(placement.hashes, exclude=set(live) - room, adapter=placement.adapter)
        # What its prompt will likely cost there: the blocks the index says that replica holds are not computed.
        ticket.prompt_tokens -= min(self._index[i].matched(placement.hashes) * self.block_size, ticket.prompt_tokens - 1)
        self._assign(placement, i)
        return i

    def _unplace(self, ticket: Ticket[int], i: int) -> None:
        self._release(ticket.payload)

    def _victims(self, i: int, priority: int) -> int:
        """Requests at replica ``i`` that one of class ``priority`` may preempt (preemptible, less urgent)."""
        return sum(p.policy.preemptible and p.policy.priority > priority for p in self._placed[i])

    # -- bookkeeping: a request counts on one replica at a time --

    def _assign(self, placement: "_Placement", i: int) -> None:
        placement.replica = i
        self._placed[i][placement] = None
        self._index[i].add(placement.hashes)
        self.in_flight[i] += 1
        self.routed[i] += 1
        self._unstarted[i][placement] = None
        if placement.adapter is not None:
            sent = self._adapters[i]
            sent.pop(placement.adapter, None)
            sent[placement.adapter] = None  # the most recent, last
            while len(sent) > max(self.replicas[i].config.max_loras, 1):
                del sent[next(iter(sent))]

    def _release(self, placement: "_Placement") -> None:
        """The request leaves its replica (ended, failed over or moved); idempotent."""
        i = placement.replica
        if i is not None:
            self.in_flight[i] -= 1
            self._unstarted[i].pop(placement, None)
            self._placed[i].pop(placement, None)
            placement.replica = None

    def _rebalance(self) -> None:
        """Start moves while the policy finds one. Each asks the source engine to release the newest request
        there that has produced no output (``EngineClient.release``): a request that had in fact started
        (a quiet one shows no output until it ends; a newer one of a more urgent class runs first) stays. While
        the engine answers, the loads count it as moved, so a free slot is offered once."""
        for _ in range(sum(map(len, self._unstarted))):  # each move takes one unstarted request: a bound
            live = self.live()
            movable = {i: sum(not p.releasing for p in self._unstarted[i]) for i in live}
            move = rebalance(self.policy, self._views(live, ()), movable)
            if move is None:
                return
            source, target = move
            placement = next(p for p in reversed(self._unstarted[source]) if not p.releasing)  # the newest
            placement.releasing = True
            self._leaving[source] += 1
            self._arriving[target] += 1
            task = asyncio.get_running_loop().create_task(self._move(placement, source, target))
            self._moves.add(task)  # referenced until done, or the loop could drop it
            task.add_done_callback(self._moves.discard)

    def _watch_queues(self) -> None:
        """Look for moves every ``rebalance_interval_s`` while any request waits unstarted, not only when a
        request ends: a replica that joins or rejoins idle, or reports less load, gets work at once."""
        interval = self.policy.rebalance_interval_s
        if (interval and (self.policy.policy == "cache-aware" or self.gate is not None)
                and (self._watch is None or self._watch.done())):
            self._watch = asyncio.get_running_loop().create_task(self._watch_loop(interval))

    async def _watch_loop(self, interval: float) -> None:
        while any(self._unstarted) or (self.gate is not None and len(self.gate)):
            await asyncio.sleep(interval)
            if self.gate is not None:
                self.gate.pump()  # a replica that joined (or reported less load) has room
            self._rebalance()

    async def _move(self, placement: "_Placement", source: int, target: int) -> None:
        try:
            released = await self.replicas[source].release(placement.request_id)
        except Exception:  # the engine's own stream reports a failure; this move just does not happen
            logger.debug("release of %s failed", placement.request_id, exc_info=True)
            released = False
        finally:
            self._leaving[source] -= 1
            self._arriving[target] -= 1
            placement.releasing = False
        if placement.replica == source:
            if released:
                stats = self.replicas[source].stats
                moved_stats, moved = self._moved_off[source]
                self._moved_off[source] = (stats, moved + 1 if moved_stats is stats else 1)
                self.moved_from[source] += 1
                self._release(placement)
                self._assign(placement, target if target in self.live() else self.pick(placement.hashes, adapter=placement.adapter))
                placement.moved.set()
                logger.debug("moved queued request %s from replica %s to replica %s",
                             placement.request_id, self.names[source], self.names[placement.replica])
            else:  # it has started there: never a candidate again
                self._unstarted[source].pop(placement, None)
        self._rebalance()


class _Placement:
    """Where one request counts now (``replica``; None once it left), and the signal that it was moved."""

    __slots__ = ("request_id", "hashes", "adapter", "policy", "replica", "moved", "releasing")

    def __init__(self, request_id: str, hashes: Sequence[bytes], adapter: str | None = None,
                 policy: RequestPolicy = DEFAULT_POLICY) -> None:
        self.request_id = request_id
        self.hashes = hashes
        self.adapter = adapter  # the request's LoRA adapter (None: the base model)
        self.policy = policy
        self.replica: int | None = None
        self.moved = asyncio.Event()
        self.releasing = False  # a release is asked of its replica and not yet answered


SERVING, DRAINING, REMOVED = "serving", "draining", "removed"  # a slot's state (ReplicaRouter.states)

_MOVED = object()  # _first_output: the request was moved before its first output
_ENDED = object()  # _first_output: the stream ended without an output


# SchedulerStats fields that add up over replicas (the rest are per step or per replica).
_SUMMED = ("num_running", "kv_blocks_used", "kv_blocks_total", "prefix_query_tokens", "prefix_hit_tokens",
           "blocks_evicted", "num_preemptions", "step_prefill_tokens", "step_decode_tokens", "total_prefill_tokens",
           "total_decode_tokens", "spec_draft_tokens", "spec_accepted_tokens", "spec_steps", "num_promotions",
           "encoder_cache_hits", "encoder_cache_misses", "encoder_cache_evictions", "encoder_cache_bytes")


def unresponsive_after_s(engine: EngineClient) -> float:
    """After how many silent seconds a replica of ``engine`` gets no new requests (the router's setting)."""
    return engine.policy.unresponsive_after_s if isinstance(engine, ReplicaRouter) else RouterConfig().unresponsive_after_s


def replicas_of(engine: EngineClient) -> list[tuple[str, EngineClient]]:
    """(name, client) of each replica behind the gateway's engine: a router's (replicas, or prefill and decode
    engines), or the one engine as "0"."""
    if isinstance(engine, ReplicaRouter):
        return [(engine.names[i], engine.replicas[i]) for i in engine.current()]
    if isinstance(engine, DisaggregatedEngines):
        return list(zip(engine.names, engine.replicas))
    return [("0", engine)]
