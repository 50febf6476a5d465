"""Disaggregated serving: prefill engines compute prompts, decode engines receive their KV and generate.

One request: the router picks a decode engine (fewest requests in flight, then most free KV blocks) and a
prefill engine (the one holding the longest run of the prompt's leading blocks, by the gateway's prefix index,
unless it is busier than the least loaded by more than ``AFFINITY_SLACK`` requests; else the least loaded). The
decode engine gets the request with a ``KVSource`` and answers which blocks its own prefix cache lacks
(``KVWanted``, tenant-salted hashes); the prefill engine then computes the prompt with ``max_tokens`` 1 and
sends exactly those blocks (``KVSink``); the decode engine continues from them and streams. Only the decode
engine's outputs reach the caller, so usage is counted once. A prompt the decode engine would rather prefill
itself (short, mostly cached) never reaches a prefill engine, and neither does a long prompt while the prefill
engine picked for it is busy (``_prefill_locally``: conditional disaggregation); if the prefill engine fails,
the decode engine is told at once (``KVSourceLost``) and prefills the prompt itself: the caller sees no error.
A prefill engine that stops answering (a frozen process: it speaks every ``LIVENESS_S``, busy or not) is taken
as failed once it has been silent for ``PREFILL_SILENCE_S``: its requests' prompts are computed by their decode
engines, it gets no new ones until it speaks again, and then it pairs afresh (a transfer cut by the freeze may
have broken the old pair's group).
A decode engine that fails before the request's first output: the request is placed again on another decode
engine.

With ``fleet_fairness`` tenant weights hold over the whole deployment (``gateway.fleet_fairness``): a request waits
in the gateway's weighted-fair queue until a decode engine has a free slot, and each tenant's counter grows by the
prompt tokens computed (by a prefill engine or by the decode engine: the decode engine's output counts as cached only
what its own prefix cache held) and the output tokens, whichever engines computed them. Prefill engines run the same
scheduler as every engine, with the request's ``RequestPolicy``: they order and preempt prompts by class and weight.
"""

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Sequence

from engine.core.outputs import RequestOutput
from engine.core.request_policy import DEFAULT_POLICY, RequestPolicy
from engine.core.sampling_params import SamplingParams
from engine.serving.async_engine import AsyncEngine, EngineError, RequestRejectedError
from engine.serving.protocol import KVSink, KVSource
from gateway.fleet_fairness import FairGate, Ticket
from gateway.prefix_index import ReplicaBlocks, block_hashes

logger = logging.getLogger(__name__)

AFFINITY_SLACK = 4  # requests a prefill engine with the prompt's prefix may have beyond the least loaded one
# A prefill engine silent this long is taken as hung (it speaks every engine_loop.LIVENESS_S, 0.25 s, even
# during a long step); a request waiting for its KV must not wait out the decode engine's --kv-transfer-timeout.
PREFILL_SILENCE_S = 1.0

# Why a decode engine computed a prompt itself (moegate_kv_local_prefills' reason label). A transfer that failed or
# timed out on the decode engine is counted there (moegate_kv_transfer_fallbacks).
LOCAL_REASONS = {
    "not_wanted": "the decode engine wanted no blocks: prompt short or mostly cached, prompt logprobs asked, or no "
                  "free blocks",
    "prefill_busy": "conditional disaggregation: the prefill engine picked had prefill_queue_tokens queued",
    "no_prefill_engine": "no prefill engine was up",
    "prefill_failed": "the prefill engine failed while computing the prompt",
    "prefill_unresponsive": "the prefill engine stopped answering while computing the prompt",
}


class PrefillSilent(EngineError):
    """The prefill engine computing a prompt stopped answering (``PREFILL_SILENCE_S``)."""


class DisaggregatedEngines:
    """Prefill and decode engines behind one ``generate`` (see the module docstring)."""

    def __init__(self, prefill: Sequence[AsyncEngine], decode: Sequence[AsyncEngine], fleet_fairness: bool = False) -> None:
        if not prefill or not decode:
            raise ValueError("disaggregated serving needs at least one prefill and one decode engine")
        self.prefill = list(prefill)
        self.decode = list(decode)
        self.config = self.decode[0].config
        # The replica label of each engine in /health and /metrics.
        self.names = [f"prefill-{i}" for i in range(len(prefill))] + [f"decode-{i}" for i in range(len(decode))]
        self._in_flight: dict[int, int] = {}  # id(engine) -> requests the router has there
        self._prefixes = {id(p): ReplicaBlocks() for p in self.prefill}
        self._pairs: dict[tuple[int, int], tuple[object, object, str]] = {}  # -> (p.info, d.info, pair id)
        self._pair_ids = itertools.count()
        self._transfer_ids = itertools.count()
        self._request_ids = itertools.count()
        self.fallbacks = 0  # requests whose prefill engine failed under them (the decode engine prefilled)
        self.local_prefills = 0  # long prompts a decode engine computed itself, every prefill engine being busy
        # (decode engine's name, reason) -> prompts it computed itself: LOCAL_REASONS' keys (/metrics).
        self.local_prefills_by: dict[tuple[str, str], int] = {}
        self._queued_tokens: dict[int, int] = {}  # id(prefill engine) -> prompt tokens sent there, not yet computed
        self._local_long: dict[int, int] = {}  # id(decode engine) -> long prompts it computes itself right now
        # Per request id, when each phase of its first token ended (time.monotonic()): set to a dict to record
        # them (the disaggregation benchmark's TTFT breakdown); None: nothing is recorded.
        self.phases: dict[str, dict[str, float]] | None = None
        # The deployment's weighted-fair queue in front of the decode engines' slots (None: each engine's own).
        self.gate: FairGate[AsyncEngine] | None = FairGate(
            self._place_fair, self._unplace, getattr(self.config, "starvation_bound_s", None),
        ) if fleet_fairness else None

    # -- EngineClient: one engine as long as a decode engine serves (prefill engines only make it faster) --

    @property
    def replicas(self) -> list[AsyncEngine]:
        return self.prefill + self.decode

    @property
    def info(self):
        return next((d.info for d in self.decode if d.info is not None and not d.dead), None)

    @property
    def dead(self) -> str | None:
        return None if any(d.dead is None for d in self.decode) else "every decode engine is down"

    @property
    def dead_detail(self) -> str | None:
        return None if self.dead is None else "; ".join(d.dead_detail or d.dead for d in self.decode)

    @property
    def stats(self):
        return next((d.stats for d in self.decode if d.stats is not None), None)

    def silent_s(self) -> float:
        return min(d.silent_s() for d in self.decode)

    async def start(self):
        readies = await asyncio.gather(*(e.start() for e in self.replicas))
        for e, ready in zip(self.replicas, readies):
            want = "prefill" if e in self.prefill else "decode"
            if ready.role != want:
                raise EngineError(f"{e.describe()} runs with role {ready.role}; start it with --role {want}")
        if len({r.block_size for r in readies}) != 1:
            raise EngineError("prefill and decode engines must use the same --block-size")
        return self.info

    async def restart(self):
        for e in self.replicas:
            if e.dead:
                await e.restart()
        return self.info

    async def shutdown(self) -> None:
        await asyncio.gather(*(e.shutdown() for e in self.replicas))

    async def prepare(self, *args, **kwargs) -> list[int]:
        return await self._live(self.decode)[0].prepare(*args, **kwargs)

    def chat_template(self) -> str | None:
        return next((d.chat_template() for d in self.decode if d.info is not None), None)

    async def detokenize(self, token_ids) -> str:
        return await self._live(self.decode)[0].detokenize(token_ids)

    async def release(self, request_id: str) -> bool:
        return False  # requests are placed once

    @staticmethod
    def _live(engines: list[AsyncEngine]) -> list[AsyncEngine]:
        live = [e for e in engines if e.info is not None and not e.dead]
        if not live:
            raise EngineError("no engine of this kind is running")
        return live

    def _load(self, engine: AsyncEngine) -> int:
        return self._in_flight.get(id(engine), 0)

    def _pick_decode(self, exclude: set[int] = frozenset()) -> AsyncEngine:
        def key(d: AsyncEngine):
            used = d.stats.kv_blocks_used / d.stats.kv_blocks_total if d.stats else 0.0
            return self._load(d), used
        live = [d for d in self._live(self.decode) if id(d) not in exclude]
        if not live:
            raise EngineError("no decode engine is running")
        return min(live, key=key)

    def _pick_prefill(self, hashes: list[bytes]) -> AsyncEngine | None:
        live = [p for p in self.prefill if p.info is not None and not p.dead and p.silent_s() < PREFILL_SILENCE_S]
        if not live:
            return None
        least = min(self._load(p) for p in live)
        near = [p for p in live if self._load(p) <= least + AFFINITY_SLACK]
        return max(near, key=lambda p: (self._prefixes[id(p)].matched(hashes), -self._load(p)))

    def _prefill_locally(self, p: AsyncEngine, d: AsyncEngine, prompt: list[int]) -> bool:
        """Conditional disaggregation: whether decode engine ``d`` computes this long prompt itself because
        ``p``, the least busy prefill engine fit for it, already has ``prefill_queue_tokens`` prompt tokens
        queued or computing (the prompt would wait behind them) while ``d`` computes no long prompt itself (its
        spare compute: at most one such prompt at a time, so its streams see at most one chunked prefill).
        Short prompts are not counted: the decode engine computes those itself anyway."""
        limit = self.config.prefill_queue_tokens
        return (limit > 0 and len(prompt) >= self.config.local_prefill_tokens
                and self._queued_tokens.get(id(p), 0) >= limit and self._local_long.get(id(d), 0) == 0)

    def _mark(self, request_id: str, phase: str, value: float | None = None) -> None:
        if self.phases is not None:
            self.phases.setdefault(request_id, {})[phase] = time.monotonic() if value is None else value

    def _pair(self, p: AsyncEngine, d: AsyncEngine) -> str:
        """The pair id of (p, d), pairing them first (again after either restarted)."""
        known = self._pairs.get((id(p), id(d)))
        if known is not None and known[0] is p.info and known[1] is d.info:
            return known[2]
        pair_id = f"p{self.prefill.index(p)}d{self.decode.index(d)}n{next(self._pair_ids)}"
        d.pair_kv(pair_id, 0, d.info.kv_address)
        p.pair_kv(pair_id, 1, d.info.kv_address)
        self._pairs[id(p), id(d)] = (p.info, d.info, pair_id)
        return pair_id

    async def generate(self, prompt: list[int], sampling_params: SamplingParams, request_id: str | None = None,
                       policy: RequestPolicy = DEFAULT_POLICY, stream: bool = True,
                       images: Sequence[bytes] = ()) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs from its decode engine (see the module docstring). A decode engine that
        fails before the request's first output: the request goes to another decode engine, if one runs.
        Images are not served split into prefill and decode: a request with some is refused."""
        if images:
            raise RequestRejectedError("images are not served with disaggregated prefill and decode; send this "
                                       "request to a server that runs both", param="messages")
        request_id = request_id or f"dreq-{next(self._request_ids)}"
        tried: set[int] = set()
        ticket: Ticket[AsyncEngine] | None = None
        placed: AsyncEngine | None = None  # the decode engine the fair queue chose (and counted) for the first try
        if self.gate is not None:
            most = None if sampling_params.max_tokens is None else sampling_params.max_tokens * sampling_params.n
            ticket, placed = await self.gate.enter(policy, len(prompt), most)
        try:
            while True:
                d, counted, placed = (placed, True, None) if placed is not None else (self._pick_decode(tried), False, None)
                produced = False
                try:
                    outputs = self._on(d, prompt, sampling_params, request_id, policy, stream, counted)
                    async with contextlib.aclosing(outputs):
                        async for out in outputs:
                            produced = True
                            if ticket is not None:
                                self.gate.charge(ticket, out)
                            yield out
                    return
                except EngineError as e:
                    tried.add(id(d))
                    if produced or not e.retryable or not any(
                            x.info is not None and not x.dead and id(x) not in tried for x in self.decode):
                        raise
                    logger.warning("request %s: decode engine failed before its first output (%s); placing it again",
                                   request_id, e)
        finally:
            if ticket is not None:
                self.gate.leave(ticket)

    def _place_fair(self, ticket: Ticket[AsyncEngine]) -> AsyncEngine | None:
        """The fair queue's ``place``: the least loaded decode engine with a free slot (counted there now), or None."""
        room = [d for d in self._live(self.decode) if self._load(d) < d.config.max_num_seqs]
        if not room:
            return None
        d = min(room, key=lambda d: (self._load(d), d.stats.kv_blocks_used / d.stats.kv_blocks_total
                                     if d.stats and d.stats.kv_blocks_total else 0.0))
        self._in_flight[id(d)] = self._load(d) + 1
        return d

    def _unplace(self, ticket: Ticket[AsyncEngine], d: AsyncEngine) -> None:
        self._in_flight[id(d)] -= 1

    async def _on(self, d: AsyncEngine, prompt: list[int], sampling_params: SamplingParams, request_id: str,
                  policy: RequestPolicy, stream_outputs: bool, counted: bool = False) -> AsyncIterator[RequestOutput]:
        """The request on decode engine ``d``, its prompt computed by a prefill engine where that pays; ``counted``:
        the fair queue already counted it in ``d``'s load."""
        if not counted:
            self._in_flight[id(d)] = self._load(d) + 1
        hashes = block_hashes(prompt, d.info.block_size, policy.cache_salt)
        p = self._pick_prefill(hashes)
        self._mark(request_id, "start")
        local_long = p is not None and self._prefill_locally(p, d, prompt)
        prefill_task: asyncio.Task | None = None
        first: asyncio.Future | None = None
        stream = None
        queued = 0  # prompt tokens this request counts in p's queue until its prefill ends
        try:
            if p is None or local_long:  # no prefill engine up, or all busy: the decode engine serves it whole
                self._count_local(d, "prefill_busy" if local_long else "no_prefill_engine")
                if local_long:
                    self.local_prefills += 1
                    self._local_long[id(d)] = self._local_long.get(id(d), 0) + 1
                    self._mark(request_id, "local")
                stream = d.generate(prompt, sampling_params, request_id, policy, stream_outputs)
                async for out in stream:
                    if local_long:  # its prompt is computed: the decode engine may take another one
                        self._local_long[id(d)] -= 1
                        local_long = False
                        self._mark(request_id, "first")
                    yield out
                return
            queued = len(prompt)
            self._queued_tokens[id(p)] = self._queued_tokens.get(id(p), 0) + queued
            pair_id = self._pair(p, d)
            source = KVSource(pair_id, next(self._transfer_ids))
            wanted = d.kv_wanted(request_id)
            stream = d.generate(prompt, sampling_params, request_id, policy, stream_outputs, kv_source=source)
            first = asyncio.ensure_future(anext(stream))
            await asyncio.wait({first, wanted}, return_when=asyncio.FIRST_COMPLETED)
            self._mark(request_id, "wanted")
            if wanted.done() and wanted.result():
                sink = KVSink(pair_id, source.transfer_id, wanted.result())
                prefill_task = asyncio.create_task(self._prefill(p, d, prompt, request_id, sink, policy))
                # Out of p's queue when the prefill ends (a callback: it runs even if the task is cancelled
                # before it started).
                prefill_task.add_done_callback(lambda _, key=id(p), n=queued: self._dequeue(key, n))
                queued = 0
            else:  # the decode engine computes it (short, cached, or no room): nothing queues at p
                self._count_local(d, "not_wanted")
                self._dequeue(id(p), queued)
                queued = 0
            try:
                out = await first
                self._mark(request_id, "first")
                yield out
            except StopAsyncIteration:
                return
            async for out in stream:
                yield out
        finally:
            self._in_flight[id(d)] -= 1
            if local_long:  # ended before its first output
                self._local_long[id(d)] -= 1
            if queued:
                self._dequeue(id(p), queued)
            if first is not None and not first.done():  # cancelled while waiting: the stream's end aborts it
                first.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await first
            if stream is not None:
                await stream.aclose()
            if prefill_task is not None and not prefill_task.done():
                prefill_task.cancel()  # closes the prefill stream: the prefill engine aborts it
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await prefill_task

    async def _prefill(self, p: AsyncEngine, d: AsyncEngine, prompt: list[int], request_id: str, sink: KVSink,
                       policy: RequestPolicy) -> None:
        """Compute the prompt on ``p`` (one token, discarded) so that it sends its blocks; on failure tell ``d``."""
        self._in_flight[id(p)] = self._load(p) + 1
        self._prefixes[id(p)].add(sink.block_hashes)
        try:
            await self._unless_silent(p, self._compute(p, prompt, request_id, sink, policy))
            self._mark(request_id, "prefilled")
        except (EngineError, ValueError) as e:
            self.fallbacks += 1
            silent = isinstance(e, PrefillSilent)
            if silent:  # a transfer the freeze cut may have broken the pair's group: the next request pairs anew
                self._pairs.pop((id(p), id(d)), None)
            self._count_local(d, "prefill_unresponsive" if silent else "prefill_failed")
            logger.warning("request %s: prefill engine failed (%s); the decode engine prefills it", request_id, e)
            d.kv_source_lost(request_id)
        finally:
            self._in_flight[id(p)] -= 1

    async def _compute(self, p: AsyncEngine, prompt: list[int], request_id: str, sink: KVSink,
                       policy: RequestPolicy) -> None:
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        async for out in p.generate(prompt, one, f"{request_id}-prefill", policy, stream=False, kv_sink=sink):
            if out.queue_time_s is not None:
                self._mark(request_id, "prefill_queue_s", out.queue_time_s)

    @staticmethod
    async def _unless_silent(p: AsyncEngine, work) -> None:
        """Await ``work`` on prefill engine ``p``; PrefillSilent (``work`` cancelled: its stream's end aborts the
        request there) once ``p`` has been silent for ``PREFILL_SILENCE_S``."""
        task = asyncio.ensure_future(work)
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=PREFILL_SILENCE_S / 4)
                if not task.done() and p.silent_s() >= PREFILL_SILENCE_S:
                    raise PrefillSilent(f"{p.describe()} stopped answering ({p.silent_s():.1f} s silent)")
            task.result()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    def _count_local(self, d: AsyncEngine, reason: str) -> None:
        key = (self.names[len(self.prefill) + self.decode.index(d)], reason)
        self.local_prefills_by[key] = self.local_prefills_by.get(key, 0) + 1

    def _dequeue(self, key: int, tokens: int) -> None:
        self._queued_tokens[key] -= tokens
