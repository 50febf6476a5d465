"""Admission: a request's engine sequences counted against its priority class's overload cap, its tokens reserved
against its tenant's quotas before the engine runs, settled with the real counts afterwards."""

import asyncio
import math
from datetime import datetime, timezone

from aiohttp import web

from gateway.errors import APIError
from tenants.quota import Denied, Granted, QuotaManager
from tenants.policy import ClassInfo

QUOTAS = web.AppKey("quotas", QuotaManager)
INFLIGHT = web.AppKey("inflight", dict)  # class priority -> engine sequences admitted and not finished

# Which x-ratelimit-* family a refused counter belongs to.
_HEADER_FAMILY = {"rpm": "requests", "concurrency": "requests", "tpm": "tokens",
                  "daily_tokens": "tokens", "monthly_tokens": "tokens"}
_MESSAGES = {
    "rpm": "rate limit reached: requests per minute",
    "tpm": "rate limit reached: tokens per minute (prompt + max_tokens are reserved up front)",
    "concurrency": "too many concurrent requests for this tenant",
    "daily_tokens": "daily token budget exhausted",
    "monthly_tokens": "monthly token budget exhausted",
}


def rate_limit_headers(grant: Granted) -> dict[str, str]:
    """x-ratelimit-* headers of a granted request (only for limits the tenant has)."""
    headers = {}
    for kind, family in (("rpm", "requests"), ("tpm", "tokens")):
        if kind in grant.windows:
            limit, remaining, reset_s = grant.windows[kind]
            headers[f"x-ratelimit-limit-{family}"] = str(limit)
            headers[f"x-ratelimit-remaining-{family}"] = str(remaining)
            headers[f"x-ratelimit-reset-{family}"] = f"{reset_s:.0f}s"
    return headers


def estimate_prompt_tokens(prompt: str | list[int]) -> int:
    """Token ids count exactly; text is estimated (about 4 bytes a token) and corrected at settle."""
    if isinstance(prompt, list):
        return len(prompt)
    return max(1, math.ceil(len(prompt.encode()) / 4))


def denied_error(denied: Denied) -> APIError:
    if denied.reason == "disabled":
        return APIError(403, "this tenant is disabled", "permission_error", code="tenant_disabled")
    if denied.reason == "max_tokens":
        return APIError(400, f"prompt + max_tokens exceeds this tenant's limit of {denied.limit} tokens per request",
                        param="max_tokens", code="max_tokens_exceeded")
    headers = {}
    if denied.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(denied.retry_after_s)))
    family = _HEADER_FAMILY.get(denied.reason)
    if family:
        headers[f"x-ratelimit-limit-{family}"] = str(denied.limit)
        headers[f"x-ratelimit-remaining-{family}"] = str(denied.remaining)
        if denied.reset_s is not None:
            headers[f"x-ratelimit-reset-{family}"] = f"{denied.reset_s:.0f}s"
    code = "insufficient_quota" if denied.reason.endswith("_tokens") else "rate_limit_exceeded"
    return APIError(429, _MESSAGES.get(denied.reason, "quota exceeded"), "rate_limit_error", code=code, headers=headers)


async def acquire(quotas: QuotaManager, tenant_id: int, tokens: int) -> Granted:
    result = await quotas.try_acquire(tenant_id, requests=1, tokens=tokens)
    if isinstance(result, Denied):
        raise denied_error(result)
    return result


class Settlements:
    """Quota work that must finish even if its handler is cancelled (a client disconnect, shutdown).

    Each piece runs as a task the app tracks, created before the handler awaits anything, so a
    second cancellation cannot skip it, and shutdown waits for all of them before closing the store.
    """

    def __init__(self) -> None:
        self._pending: set[asyncio.Task] = set()

    def run(self, work) -> asyncio.Task:
        task = asyncio.create_task(work)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    async def acquire(self, quotas: QuotaManager, tenant_id: int, tokens: int) -> Granted:
        """``acquire``; if the caller is cancelled meanwhile, a grant that still arrives is released."""
        decided = quotas.try_acquire_cached(tenant_id, requests=1, tokens=tokens)
        if decided is not None:  # the cached policy decided, with no await: nothing to protect
            if isinstance(decided, Denied):
                raise denied_error(decided)
            return decided
        task = self.run(acquire(quotas, tenant_id, tokens))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            def release_late_grant(t: asyncio.Task) -> None:
                if not t.cancelled() and t.exception() is None:
                    self.run(quotas.release(t.result()))
            task.add_done_callback(release_late_grant)
            raise

    async def drain(self) -> None:
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)


SETTLEMENTS = web.AppKey("settlements", Settlements)


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


def reservation(prompt_lengths: list[int], n: int, max_tokens: int | None, max_model_len: int,
                default_tokens: int) -> int:
    """Tokens to reserve at admission: each prompt once, plus ``n`` outputs of ``max_tokens`` each (never more
    than the context leaves room for). Without ``max_tokens`` an output may run to the end of the context;
    ``default_tokens`` of it are reserved, and the settle charges what it really used."""
    total = 0
    for length in prompt_lengths:
        room = max_model_len - length
        total += length + n * min(max_tokens if max_tokens is not None else default_tokens, room)
    return total


async def admit(app: web.Application, caps: dict[int, int], cls: ClassInfo, tenant_id: int, sequences: int,
                tokens: int) -> Granted:
    """Count ``sequences`` engine sequences in flight for ``cls`` (503 ``overloaded`` if its class already has
    ``caps[cls.priority]`` or more) and reserve ``tokens`` of the tenant's quotas (``APIError`` as ``denied_error``
    says). Refused or cancelled, nothing stays counted; admitted, the caller gives the sequences back with
    ``release``."""
    inflight = app[INFLIGHT]
    check_class_room(app, caps, cls)
    # Counted from here, before any await, so a burst cannot all pass the check above at once.
    # Engine sequences, not HTTP requests: n copies of each prompt load the engine as n requests would.
    inflight[cls.priority] = inflight.get(cls.priority, 0) + sequences
    try:
        return await app[SETTLEMENTS].acquire(app[QUOTAS], tenant_id, tokens)
    except BaseException:
        release(app, cls, sequences)
        raise


def check_class_room(app: web.Application, caps: dict[int, int], cls: ClassInfo) -> None:
    """503 ``overloaded`` if ``cls`` already has ``caps[cls.priority]`` engine sequences in flight."""
    cap = caps.get(cls.priority)
    if cap is not None and app[INFLIGHT].get(cls.priority, 0) >= cap:
        raise APIError(503, f"server overloaded for priority class {cls.name!r}; retry shortly", "server_error",
                       code="overloaded", headers={"Retry-After": "2"})


async def check_quotas_open(quotas: QuotaManager, tenant_id: int) -> None:
    """The tenant's refusal (``denied_error``) if a request of one token would be refused now; reserves nothing
    (a dry run: ``admit`` reserves the request's real tokens later)."""
    decided = quotas.try_acquire_cached(tenant_id, requests=1, tokens=1)
    if decided is None:
        decided = await quotas.try_acquire(tenant_id, requests=1, tokens=1, dry_run=True)
    if isinstance(decided, Denied):
        raise denied_error(decided)


def release(app: web.Application, cls: ClassInfo, sequences: int) -> None:
    """The end of ``sequences`` that ``admit`` counted for ``cls``."""
    app[INFLIGHT][cls.priority] -= sequences
