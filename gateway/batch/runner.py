"""The batch runner: feeds leased batch lines to the engine at the batch rank and finalizes batches.

One runner per gateway process. It claims lines only while the engine has no
live request waiting (batch work takes idle capacity; the engine's scheduler
also serves better ranks first and preempts batch work for them), keeps at
most ``max_inflight`` lines in the engine, renews its leases while they run,
and writes line results with ``BatchStore.finish_and_claim`` (exactly once, even
if another gateway took a line over after a crash). When a batch has no line
left it writes the output and error files and sets the final status.

Throughput: ``max_inflight`` should exceed the engine's ``max_num_seqs`` (the
gateway defaults to twice it), so lines wait *inside* the engine at the batch
rank and take a slot the step after one frees, instead of the engine running
dry while finished lines are written and new ones claimed. Results are written
by one writer task, everything finished since its last write in one transaction
(group commit, as the usage ledger does), and the same transaction claims lines
for the room they freed: a wave of lines finishing together costs one commit,
not one each, and no separate claim. A result not yet written when the process dies
is simply lost with its lease, and the line runs again: nothing is done twice.
"""

import asyncio
import json
import logging
import os
import socket
import time
import uuid

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gateway.batch.validation import ENDPOINTS
from engine.core.request_policy import RequestPolicy
from engine.serving.client import EngineClient
from gateway.batch.line_completion import complete
from gateway.chat_images import ImageLimits
from gateway.completion import NOT_RETRIED
from gateway.response_bodies import completion_body, system_fingerprint
from gateway.responses import batch_lines
from gateway.responses.translate import responses_error
from gateway.errors import APIError
from gateway.lora_adapters import AdapterCatalog
from gateway.openai_schema import decode_body
from gateway.pipeline import Adapter
from gateway.remote_images import RemoteImagePolicy
from tenants.batch_store import BatchStore, ClaimedLine, FileInfo, FinishedLine, new_id
from tenants.models import utcnow
from tenants.store import UsageRecord
from tenants.ttl_cache import RefreshingCache

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class BatchRunnerConfig:
    lease_s: float = 60.0
    max_inflight: int = 32
    poll_s: float = 0.5
    batch_priority: int = 2  # the `batch` priority class's priority (RequestPolicy.priority)
    expiry_check_s: float = 5.0
    max_write_batch: int = 512  # line results per transaction
    retry_s: float = 1.0  # after a failed write
    remote_images: RemoteImagePolicy | None = None  # which remote image URLs lines may name (None: none)

    def __post_init__(self) -> None:
        if self.max_inflight < 1 or self.max_write_batch < 1:
            raise ValueError("max_inflight and max_write_batch must be >= 1")
        if self.lease_s <= 0 or self.poll_s <= 0 or self.retry_s < 0:
            raise ValueError("lease_s and poll_s must be > 0, retry_s >= 0")


SALT_TTL_S = 60.0  # a tenant's salt never changes; the bound only keeps a deleted id's from being served on


def error_result(custom_id: str, code: str, message: str) -> dict:
    return {"id": new_id("batch_req_"), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def batch_line_policy(priority: int, tenant_id: int, cache_salt: str, cache_share: float | None = None,
                      lora_adapter: str | None = None) -> RequestPolicy:
    """A Batch API line's policy: the batch class's priority, idle capacity only (background), preemptible,
    its tenant's fair share, prefix cache (its secret ``cache_salt``, as its live requests) and share of the
    prefix-cache tiers, the LoRA adapter its ``model`` named (None: the base model)."""
    return RequestPolicy(priority=priority, tenant=str(tenant_id), preemptible=True, background=True,
                         cache_salt=cache_salt, cache_share=cache_share, lora_adapter=lora_adapter)


async def execute_line(engine: EngineClient, model: str, endpoint: str, custom_id: str, body_json: str,
                       policy: RequestPolicy, adapters: AdapterCatalog | None = None,
                       tenant_id: int | None = None, remote_images: RemoteImagePolicy | None = None,
                       image_limits: Callable[[], Awaitable[ImageLimits]] | None = None
                       ) -> tuple[bool, dict, object]:
    """Run one batch line like the live API would; (ok, output line, its choices' usage or None).

    A 4xx the live API would answer becomes the line's response (status and error body), and so does
    a failed engine step the line was part of (it may be the cause: never retried into a fresh
    engine); an engine outage raises APIError(503) so the caller can retry the line later. With ``adapters``,
    a line whose ``model`` names a LoRA adapter tenant ``tenant_id`` may use runs under it (its response's
    ``model`` says which); any other model is the live API's 404. ``remote_images``: which remote image URLs
    are fetched, as for the live API (None: none).
    """
    chat = endpoint != "/v1/completions"
    rid = new_id("batch_req_")
    places: list[str | None] = []  # a Responses line's chat messages' input items
    try:
        render = completion_body
        if endpoint == batch_lines.ENDPOINT:
            req, body, tools = batch_lines.line_request(body_json.encode(), places)
            render = batch_lines.renderer(req, tools)
        else:
            body = decode_body(body_json.encode(), ENDPOINTS[endpoint])
        adapter = None
        if adapters is not None:
            name, path = await adapters.resolve(tenant_id, body.model, model)
            if name is not None:  # loaded onto the engine by the pipeline, after the line's prompts are checked
                adapter, model = Adapter(adapters, name, path), name
        response, last = await complete(engine, body, chat, rid, int(time.time()), model,
                                        system_fingerprint(engine.config, model), policy=policy, adapter=adapter,
                                        render=render, remote_images=remote_images, image_limits=image_limits)
    except APIError as e:
        if endpoint == batch_lines.ENDPOINT:
            e = responses_error(e, places)  # the chat fields it names, as the Responses API calls them
        if e.status >= 500 and e.code not in NOT_RETRIED:  # the engine is down: the line runs again later
            raise
        body = {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}
        return False, {"id": rid, "custom_id": custom_id,
                       "response": {"status_code": e.status, "request_id": rid, "body": body}, "error": None}, None
    return True, {"id": rid, "custom_id": custom_id,
                  "response": {"status_code": 200, "request_id": rid, "body": response}, "error": None}, last


class BatchRunner:
    def __init__(self, batches: BatchStore, engine: EngineClient, model_name: Callable[[], str], config: BatchRunnerConfig,
                 wake: asyncio.Event | None = None,
                 cache_share: Callable[[int], Awaitable[float | None]] | None = None,
                 adapters: AdapterCatalog | None = None,
                 image_limits: Callable[[int], Awaitable[ImageLimits]] | None = None) -> None:
        """``cache_share``: a tenant's share of the prefix-cache tiers (``QuotaManager.cache_share``; None: shared);
        ``adapters``: the LoRA adapters lines may name as their model (None: the base model only);
        ``image_limits(tenant_id)``: the limits a tenant's lines' images are read under (``gateway.image_policy``;
        None: ``DEFAULT_IMAGE_LIMITS``)."""
        self.batches, self.engine, self.model_name, self.config = batches, engine, model_name, config
        self.cache_share, self.adapters, self.image_limits = cache_share, adapters, image_limits
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._salts: RefreshingCache[str] = RefreshingCache(SALT_TTL_S)  # tenant id -> its prefix-cache salt
        self.wake = wake or asyncio.Event()
        self._running: dict[int, asyncio.Task] = {}  # line id -> task
        self._unwritten: dict[int, FinishedLine] = {}  # line id -> result not yet committed (lease still held)
        self._results_ready = asyncio.Event()
        self._claiming = 0  # lines asked for by a claim in flight (counted against max_inflight)
        self._writing: asyncio.Future | None = None  # the result write in flight
        self._ticking: asyncio.Future | None = None  # the main loop's step in flight
        self._stopping = False
        self._last_expiry_check = 0.0
        self.writes = 0  # transactions that wrote results (for tests and benchmarks)

    def _live_waiting(self) -> int:
        stats = self.engine.stats
        if stats is None:
            return 0
        return sum(n for priority, n in stats.num_waiting_by_priority.items() if priority < self.config.batch_priority)

    async def run(self) -> None:
        """The long-lived loop (started and cancelled with the app)."""
        renewer = asyncio.create_task(self._renew_leases())
        writer = asyncio.create_task(self._write_results())
        try:
            while True:
                # Shielded, as the writer's transactions are: a cancel that cut a transaction on the async
                # store short would leave its connection holding SQLite's write lock until collected, and
                # the last write and the lease release below would wait on it. Shutdown waits for the step.
                self._ticking = asyncio.ensure_future(self._tick())
                try:
                    await asyncio.shield(self._ticking)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    logger.exception("batch runner step failed; retrying")
                # asyncio.timeout, not wait_for: on Python 3.11 a wait_for whose inner wait finishes as
                # the task is cancelled returns normally and the cancel is lost (the app's shutdown then
                # waited for the runner forever; tests/gateway/test_batch_runner_stop.py caught it).
                try:
                    async with asyncio.timeout(self.config.poll_s):
                        await self.wake.wait()
                except TimeoutError:
                    pass
                self.wake.clear()
        finally:
            self._stopping = True
            renewer.cancel()
            writer.cancel()
            tasks = list(self._running.values())
            for t in tasks:
                t.cancel()
            await asyncio.gather(renewer, writer, *tasks, return_exceptions=True)
            # A step or a write in flight runs to its end (the write commits on the worker thread anyway):
            # take its outcome.
            await asyncio.gather(*(f for f in (self._ticking, self._writing) if f is not None), return_exceptions=True)
            try:  # results already in hand are kept (one last write); a failure leaves them to run again
                await self._write_some(refill=False)
            except Exception:
                logger.exception("could not write %d finished batch lines; they will run again", len(self._unwritten))
            try:  # stopping on purpose: let the next start (or another gateway) take our lines at once
                await self.batches.release_all(self.owner)
            except Exception:
                logger.exception("could not release batch leases; they lapse in %.0f s", self.config.lease_s)

    async def _tick(self) -> None:
        now = time.monotonic()
        if now - self._last_expiry_check >= self.config.expiry_check_s:
            self._last_expiry_check = now
            await self.batches.expire_overdue()
        for batch_id in await self.batches.ready_to_finalize():
            await self.finalize(batch_id)
        room = self._claim_room()
        if room:
            self._claiming += room
            try:
                lines = await self.batches.claim(self.owner, room, self.config.lease_s)
            finally:
                self._claiming -= room
            self._start(lines)

    def _claim_room(self) -> int:
        """How many lines to claim now: none while the engine is down or live requests wait (batch work
        takes idle capacity only), else the room under ``max_inflight``."""
        engine_ready = self.engine.info is not None and not self.engine.dead
        if not engine_ready or self._live_waiting() > 0:
            return 0
        return max(0, self.config.max_inflight - len(self._running) - self._claiming)

    def _start(self, lines: list[ClaimedLine]) -> None:
        if self._stopping:
            return  # claimed while stopping: release_all hands them back
        for line in lines:
            self._running[line.id] = asyncio.create_task(self._run_line(line))

    def _image_limits(self, tenant_id: int) -> Callable[[], Awaitable[ImageLimits]] | None:
        return None if self.image_limits is None else (lambda: self.image_limits(tenant_id))

    async def _run_line(self, line: ClaimedLine) -> None:
        try:
            share = await self.cache_share(line.tenant_id) if self.cache_share is not None else None
            salt = await self._salts.get(line.tenant_id, lambda: self.batches.store.cache_salt(line.tenant_id))
            policy = batch_line_policy(self.config.batch_priority, line.tenant_id, salt, share)
            base = self.model_name()
            ok, result, last = await execute_line(self.engine, base, line.endpoint, line.custom_id,
                                                  line.body_json, policy, self.adapters, line.tenant_id,
                                                  self.config.remote_images, self._image_limits(line.tenant_id))
            usage = None
            if last is not None:
                served = result["response"]["body"].get("model", base)  # an adapter's name if the line named one
                usage = UsageRecord(tenant_id=line.tenant_id, request_id=result["id"], model=base,
                                    prompt_tokens=last.num_prompt_tokens, completion_tokens=last.num_output_tokens,
                                    cached_prompt_tokens=last.num_cached_tokens, batch=True,
                                    finish_reason=last.finish_reason, finished_at=utcnow(),
                                    adapter=None if served == base else served)
            # Handed to the writer; the lease stays held (and renewed) until the result is committed.
            self._unwritten[line.id] = FinishedLine(line, ok, result, usage)
            self._results_ready.set()
        except APIError as e:  # the engine is down: leave the line to be claimed again
            logger.warning("batch line %s of %s not run (%s); it will be retried", line.custom_id, line.batch_id, e)
            await self.batches.renew(self.owner, [line.id], -1.0)  # lapse the lease now
        finally:
            self._running.pop(line.id, None)

    async def _write_some(self, refill: bool = True) -> None:
        """Commit up to ``max_write_batch`` finished lines in one transaction, which (``refill``) also
        claims lines for the room they freed."""
        items = list(self._unwritten.values())[: self.config.max_write_batch]
        if not items:
            return
        limit = self._claim_room() if refill else 0
        self._claiming += limit
        try:
            written, claimed = await self.batches.finish_and_claim(self.owner, items, limit, self.config.lease_s)
        finally:
            self._claiming -= limit
        for item, ok in zip(items, written):  # only after the commit: a failed write keeps its items
            del self._unwritten[item.line.id]
            if not ok:
                logger.warning("batch line %s of %s was already finished or taken over by another runner; result dropped",
                               item.line.custom_id, item.line.batch_id)
        self.writes += 1
        self._start(claimed)
        if refill and (not limit or len(claimed) < limit):
            # No lines left to run (a batch may be ready to finalize), or none could be claimed now:
            # the main loop looks. While lines keep coming, it is not woken per write.
            self.wake.set()

    async def _write_results(self) -> None:
        while True:
            await self._results_ready.wait()
            self._results_ready.clear()
            while self._unwritten:
                # Shielded: cancelling the runner does not cut a write short (its transaction commits on
                # the worker thread either way); the runner's shutdown waits for it and takes its outcome.
                self._writing = asyncio.ensure_future(self._write_some())
                try:
                    await asyncio.shield(self._writing)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    logger.exception("writing %d batch results failed; retrying", len(self._unwritten))
                    await asyncio.sleep(self.config.retry_s)

    async def _renew_leases(self) -> None:
        while True:
            await asyncio.sleep(self.config.lease_s / 3)
            try:
                await self.batches.renew(self.owner, list(self._running) + list(self._unwritten), self.config.lease_s)
            except Exception:
                logger.exception("renewing batch leases failed")

    async def finalize(self, batch_id: str) -> None:
        """Write the output and error files and the final status (under the batch's lease)."""
        batch = await self.batches.begin_finalizing(self.owner, batch_id, self.config.lease_s)
        if batch is None:
            return
        output, errors = [], []
        for _line_no, custom_id, status, result_json in await self.batches.lines_of(batch_id):
            if status == "done":
                output.append(result_json)
            elif status == "failed":
                errors.append(result_json)
            elif status == "expired":
                errors.append(json.dumps(error_result(custom_id, "batch_expired",
                                                      "the batch expired before this request could be run")))
            elif status == "cancelled":
                errors.append(json.dumps(error_result(custom_id, "batch_cancelled",
                                                      "the batch was cancelled before this request was run")))
        files: list[tuple[FileInfo, bytes]] = []
        ids = {}
        for kind, lines in (("output", output), ("error", errors)):
            if not lines:
                continue
            file_id = new_id("file-")
            data = ("\n".join(lines) + "\n").encode()
            files.append((FileInfo(file_id, batch.tenant_id, f"{batch_id}_{kind}.jsonl", "batch_output", len(data), "",
                                   utcnow()), data))
            ids[kind] = file_id
        final = "cancelled" if batch.cancelling_at else "expired" if batch.expired_at else "completed"
        # The files are stored with the final status, in one transaction; if the lease was lost meanwhile
        # nothing is stored and the runner that took over writes its own.
        await self.batches.complete_finalizing(self.owner, batch, files, ids.get("output"), ids.get("error"), final)
