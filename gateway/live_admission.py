"""A live API request's admission and settle: the ``Admission`` the app hands ``gateway.pipeline.run``.

Admission counts the request's engine sequences against its class's overload cap and reserves its tokens against
the tenant's quotas (``gateway/admission.py``); a refusal is counted and timed. The settle writes the request's
real usage (None if it never started) to its timer and the ledger, which releases what was not used, and closes
its engine streams (aborting what has not finished).
"""

import asyncio

from aiohttp import web

from engine.core.request_policy import RequestPolicy
from gateway.admission import (
    QUOTAS, SETTLEMENTS, admit, check_class_room, check_quotas_open, rate_limit_headers, release, reservation, utcnow,
)
from gateway.app_keys import CONFIG, DRAINING, ENGINE, LEDGER
from gateway.auth import PRINCIPAL, Principal
from gateway.choices import Choices
from gateway.completion import engine_down
from gateway.errors import APIError
from gateway.metrics import METRICS, RequestTimer
from gateway.pipeline import Outputs, Planned
from gateway.request_keys import CHOICES, RATE_HEADERS, TIMER
from gateway.slo_admission import REFUSED_CODE, SLO, Ticket, judge, refusal_objective
from gateway.stream_journal import JOURNALED, STREAM_JOURNAL, JournaledStream
from tenants.quota import Granted
from tenants.store import UsageRecord


def check_open(app: web.Application) -> None:
    """503 while the server shuts down (a new request on a kept-alive connection) or its engine is down."""
    if app[DRAINING].is_set():
        raise APIError(503, "the server is shutting down; retry on another replica or shortly", "server_error",
                       code="shutting_down", headers={"Retry-After": "5", "Connection": "close"})
    if app[ENGINE].dead:
        raise engine_down(app[ENGINE].dead)


async def refuse_early(request: web.Request) -> None:
    """The admission checks that need neither the prompt nor a reservation, for a route with costly work before
    its prompt exists (the Responses API reads and decodes a stored conversation first): the server open
    (``check_open``), room in the tenant's class, and the tenant's quotas open for a request of one token (a dry
    run: 429 past a rate or budget, 403 disabled). A refusal is counted as ``LiveAdmission.admit``'s are; that
    still reserves the request's tokens once its prompt is known."""
    app, principal = request.app, request[PRINCIPAL]
    check_open(app)
    tenant, cls = principal.tenant, principal.priority_class
    try:
        check_class_room(app, app[CONFIG].max_inflight_by_priority, cls)
        await check_quotas_open(app[QUOTAS], tenant.id)
    except APIError as refused:
        app[METRICS].rejections.labels(tenant.name, cls.name, refused.code or str(refused.status)).inc()
        raise


class LiveAdmission:
    """``pipeline.Admission`` for a request on the live API. ``adapter``: the LoRA adapter its ``model`` named
    (None: the base model ``base_model``)."""

    def __init__(self, request: web.Request, rid: str, base_model: str, adapter: str | None) -> None:
        self.request, self.rid, self.base_model, self.adapter = request, rid, base_model, adapter
        self.principal: Principal = request[PRINCIPAL]
        self.sequences = 0
        self.grant: Granted | None = None
        self.ticket: Ticket | None = None  # its place in SLO admission's queue ahead
        self.started_at = None

    def check_open(self) -> None:
        """503 while the server shuts down (a new request on a kept-alive connection) or its engine is down."""
        check_open(self.request.app)

    async def admit(self, planned: Planned) -> RequestPolicy:
        """The reservation, the request's timer and rate-limit headers, its choices (and, streamed, its journal
        entry, so a killed gateway still bills what it delivered); the tenant's policy for it."""
        request = self.request
        self.grant = await self._reserve(planned)
        self.sequences = planned.sequences
        self.started_at = utcnow()
        if planned.body.stream:
            request[JOURNALED] = JournaledStream(request.app[STREAM_JOURNAL], self.grant, self.usage_record(
                prompt_tokens=0, completion_tokens=0))
        request[CHOICES] = Choices(planned.prompt_lengths, planned.sampling_params.n, whole=not planned.body.stream)
        return self.principal.policy(cache_share=self.grant.cache_share, lora_adapter=self.adapter)

    async def _reserve(self, planned: Planned) -> Granted:
        """``gateway.admission.admit`` with the request's reservation; a refusal is counted and timed."""
        request = self.request
        app, config = request.app, request.app[CONFIG]
        tenant, cls = self.principal.tenant, self.principal.priority_class
        params = planned.sampling_params
        reserved = reservation(planned.prompt_lengths, params.n, params.max_tokens, app[ENGINE].info.max_model_len,
                               config.default_reservation_tokens)
        timer = RequestTimer(app[METRICS], tenant.name, cls.name, self.adapter)
        prompt_tokens = sum(planned.prompt_lengths)
        try:
            app[SLO].check(cls, prompt_tokens)  # no await: a refusal is answered at once
            grant = await admit(app, config.max_inflight_by_priority, cls, tenant.id, planned.sequences, reserved)
        except APIError as refused:
            app[METRICS].rejections.labels(tenant.name, cls.name, refused.code or str(refused.status)).inc()
            if refused.code == REFUSED_CODE:
                app[METRICS].slo_outcome(tenant.name, cls.name, "refused")
            timer.finish(refused.status, None)
            raise
        # Each sequence's expected output: its max_tokens, else the reservation's estimate (within the context).
        longest = max(planned.prompt_lengths, default=0)
        outputs = min(params.max_tokens if params.max_tokens is not None else config.default_reservation_tokens,
                      max(1, app[ENGINE].info.max_model_len - longest))
        self.ticket = app[SLO].ticket(cls.priority, prompt_tokens, planned.sequences, outputs, cls.preempt_grace_ms,
                                     refusal_objective(cls))
        timer.on_first = self.ticket.first_token
        request[TIMER] = timer
        request[RATE_HEADERS] = rate_limit_headers(grant)
        return grant

    def usage_record(self, **counts) -> UsageRecord:
        return UsageRecord(tenant_id=self.principal.tenant.id, request_id=self.rid, model=self.base_model,
                           key_id=self.principal.key.id, started_at=self.started_at, adapter=self.adapter, **counts)

    async def settle(self, outputs: Outputs | None, status: int) -> None:
        """The class's sequences released; the usage (None if it never started) to the timer and the ledger."""
        request = self.request
        app, choices = request.app, request[CHOICES]
        cls, timer = self.principal.priority_class, request[TIMER]
        release(app, cls, self.sequences)
        self.ticket.close()
        status = final_status(status, choices)
        usage: UsageRecord | None = None
        completion_tokens = choices.num_output_tokens if choices.started else 0
        met = judge(cls, status, timer.ttft_s(), timer.mean_itl_s(completion_tokens))
        if choices.started:
            usage = self.usage_record(
                prompt_tokens=choices.num_prompt_tokens, completion_tokens=completion_tokens,
                cached_prompt_tokens=choices.num_cached_tokens, finish_reason=choices.finish_reason or "abort",
                finished_at=utcnow(), http_status=status, priority_class=cls.name, slo_met=met,
            )
        app[METRICS].slo_outcome(self.principal.tenant.name, cls.name,
                                 "none" if met is None else "met" if met else "missed",
                                 completion_tokens if status == 200 and met is not False else 0)
        timer.finish(status, usage)
        if outputs is None or choices.finished:
            # Nothing left to abort: hand the usage over now, with no await before it. Going through
            # a shielded task costs every request a turn of the event loop behind whatever else is
            # ready, which was the gateway's largest share of its slowest requests under load.
            app[LEDGER].submit(self.grant, usage)
            if outputs is not None:
                await outputs.aclose()  # a finished stream closes without suspending
        else:
            # Created before any await, so a second cancellation cannot skip it.
            await asyncio.shield(app[SETTLEMENTS].run(_close_and_settle(app, outputs, self.grant, usage)))


def final_status(status: int, choices: Choices) -> int:
    """The status the usage row records: a stream's 200 went out with its headers, before its end."""
    if status == 200 and choices.started and not choices.finished:
        return 503  # a stream the engine failed mid-way: 200 went out with the headers, the row says so
    if status == 200 and choices.failed:
        return 500  # a stream whose output failed (its error event went out after the 200)
    return status


async def _close_and_settle(app: web.Application, outputs: Outputs, grant: Granted, usage: UsageRecord | None) -> None:
    # Closing the stream aborts the engine request if it has not finished (client gone, error):
    # its KV blocks come back at once.
    await outputs.aclose()
    app[LEDGER].submit(grant, usage)  # usage None: the request never ran, the reservation is released
