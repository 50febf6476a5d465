"""Authentication: `Authorization: Bearer mg-...` -> the tenant, with a short-lived lookup cache."""

import hashlib
import hmac
import time
from dataclasses import dataclass, field

from aiohttp import web

from engine.core.request_policy import RequestPolicy
from gateway.errors import APIError
from tenants.policy import ClassInfo
from tenants.store import KeyInfo, TenantInfo, TenantStore
from tenants.ttl_cache import RefreshingCache


@dataclass(slots=True, frozen=True)
class Principal:
    """Who is calling, and the policy their priority class gives their requests."""

    tenant: TenantInfo
    key: KeyInfo
    priority_class: ClassInfo
    cache_salt: str = field(repr=False)  # the tenant's secret prefix-cache salt (``TenantStore.cache_salt``)

    def policy(self, order_in_class: int = 0, background: bool = False, cache_share: float | None = None,
               lora_adapter: str | None = None) -> RequestPolicy:
        """The engine's policy for this caller's requests: the class's priority and preemption rules (with its
        grace before preempting, from its time-to-first-token objective), the tenant's fair-share weight, its
        prefix cache kept to itself (salted by its secret salt, never by its id, which another database hands out
        again), its quota's share of the engine's prefix-cache tiers (``Granted.cache_share``) and the LoRA
        adapter its ``model`` named (``gateway.lora_adapters``; None: the base model)."""
        tenant, cls = self.tenant, self.priority_class
        return RequestPolicy(priority=cls.priority, order_in_class=order_in_class, tenant=str(tenant.id),
                             weight=tenant.weight, preemptible=cls.preemptible, may_preempt=cls.may_preempt,
                             preempt_grace_ms=cls.preempt_grace_ms, background=background,
                             cache_salt=self.cache_salt, cache_share=cache_share, lora_adapter=lora_adapter)


class Authenticator:
    """Resolves keys through the store; results (misses too) are cached for ``ttl_s``.

    The TTL bounds how long a revoked key or a disabled tenant keeps working
    (the issue asks for 5 s), while sparing the database a query per request.
    """

    def __init__(self, store: TenantStore, ttl_s: float = 5.0, clock=time.monotonic) -> None:
        self.store = store
        self._cache: RefreshingCache[Principal | None] = RefreshingCache(ttl_s, clock=clock)

    async def lookup(self, plaintext: str) -> Principal | None:
        digest = hashlib.sha256(plaintext.encode()).digest()  # never keep keys in clear, even in memory
        return await self._cache.get(digest, lambda: self._load(plaintext))

    async def _load(self, plaintext: str) -> Principal | None:
        found = await self.store.authenticate(plaintext, include_disabled=True)
        if found is None:
            return None
        tenant, key = found
        return Principal(tenant, key, await self.store.get_class(tenant.priority_class),
                         await self.store.cache_salt(tenant.id))


PRINCIPAL = web.RequestKey("principal", Principal)


def require_token(request: web.Request, token: str, what: str) -> None:
    """401 unless the request carries ``Authorization: Bearer <token>`` (the operator's token for ``what``:
    metrics, admin), compared in constant time."""
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    # surrogateescape: header bytes that are not UTF-8 (aiohttp passes them on as surrogates) compare as themselves
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"),
                                                             token.encode()):
        raise APIError(401, f"{what} needs 'Authorization: Bearer <{what} token>'", "authentication_error",
                       code=f"invalid_{what}_token", headers={"WWW-Authenticate": "Bearer"})
KEYED_PATHS = ("/tokenize", "/detokenize")  # outside /v1/ (vLLM's paths), behind the key all the same
AUTHENTICATOR = web.AppKey("authenticator", Authenticator)


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, "authentication_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


@web.middleware
async def auth_middleware(request: web.Request, handler):
    """Every /v1/ route (and /tokenize, /detokenize) needs a valid key of an active tenant; /health stays open
    (/metrics has its own check)."""
    if not (request.path.startswith("/v1/") or request.path in KEYED_PATHS):
        return await handler(request)
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if not header.strip():
        raise _unauthorized("missing API key: send the header 'Authorization: Bearer mg-...'")
    if scheme.lower() != "bearer" or not token.strip():
        # Not echoed back: a header without the scheme is often the key itself.
        raise _unauthorized("the Authorization header must be 'Bearer <API key>': send 'Authorization: Bearer mg-...'")
    token = token.strip()
    if not (token.isascii() and token.isprintable()):  # keys are ASCII; other bytes cannot be one
        raise _unauthorized("invalid API key (unknown, revoked or expired)")
    principal = await request.app[AUTHENTICATOR].lookup(token)
    if principal is None:
        raise _unauthorized("invalid API key (unknown, revoked or expired)")
    if principal.tenant.status != "active":
        raise APIError(403, f"tenant {principal.tenant.name!r} is disabled", "permission_error", code="tenant_disabled")
    request[PRINCIPAL] = principal
    return await handler(request)
