"""What a request's tenant and priority class ask of the engine: one struct from the gateway to the scheduler.

The gateway builds it once per request (``gateway.auth.Principal.policy``: the tenant and its priority class,
plus the API's ``priority``); it crosses the pipe and remote engines' TCP connections unchanged (msgpack) and
every request copy of an ``n`` > 1 request shares it. A new per-request setting is a new field here, with its
default and its check in ``__post_init__``: nothing between the gateway and the scheduler names the fields.
"""

import msgspec


class RequestPolicy(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How the scheduler treats one request.

    ``priority``: its priority class, lower is more urgent (the tenants database's ``rank`` column).
    ``order_in_class`` (>= 0): its place among the waiting requests of its class, whichever tenant's: it waits
    behind every one with a smaller value (the API's vLLM-style ``priority``, which can so lower a request but
    never raise it above its class). ``tenant`` and ``weight`` (> 0): whose fair share within the class it
    draws on, and how large that share is. ``preemptible``: a waiting request of a more urgent class may take
    its place; ``may_preempt``: it may take the place of a preemptible request of a less urgent class.
    ``preempt_grace_ms`` (>= 0, or None: at once): how long it waits for a slot or blocks to free by themselves
    before it takes a less urgent request's place (the gateway sets part of its class's time-to-first-token
    objective: a slot usually frees within it, and the request that would have been preempted keeps its
    progress and its own objectives).
    ``background``: it takes idle capacity only (the Batch API's lines; ``SchedulerConfig``).
    ``cache_salt``: its prefix-cache blocks are shared only with requests of the same salt (the tenant).
    ``cache_share`` (0 < share <= 1): the tenant's share of the engine's host and disk prefix-cache tiers and of
    its vision-encoder cache (its quota's; past it, its new blocks and images evict its own); None: the tiers are
    one LRU shared by every tenant, and the encoder cache holds it to ``EngineConfig.encoder_cache_tenant_share``.
    ``lora_adapter``: the registered LoRA adapter it runs under (None: the base model); a separate, typed part of
    every prefix-cache block hash, so the same prompt under two adapters never shares blocks.

    Validated when built and again when decoded in the engine process (a ValueError naming the field).
    """

    priority: int = 1
    order_in_class: int = 0
    tenant: str = "default"
    weight: float = 1.0
    preemptible: bool = True
    may_preempt: bool = True
    preempt_grace_ms: float | None = None
    background: bool = False
    cache_salt: str | None = None
    cache_share: float | None = None
    lora_adapter: str | None = None

    def __post_init__(self) -> None:
        if self.priority < 0:
            raise ValueError(f"priority must be >= 0, got {self.priority}")
        if self.order_in_class < 0:
            raise ValueError(f"order_in_class must be >= 0, got {self.order_in_class}")
        if self.preempt_grace_ms is not None and not self.preempt_grace_ms >= 0:
            raise ValueError(f"preempt_grace_ms must be >= 0 or None, got {self.preempt_grace_ms}")
        if not self.weight > 0:
            raise ValueError(f"weight must be > 0, got {self.weight}")
        if self.cache_share is not None and not 0 < self.cache_share <= 1:
            raise ValueError(f"cache_share must be in (0, 1] or None, got {self.cache_share}")
        if self.lora_adapter is not None and not self.lora_adapter:
            raise ValueError("lora_adapter must be a non-empty adapter name or None (the base model)")


DEFAULT_POLICY = RequestPolicy()
