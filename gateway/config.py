"""The gateway's typed config."""

from dataclasses import dataclass, field


def _default_inflight_caps() -> dict[int, int]:
    # rank -> most engine sequences in flight (queued in the engine or running; a request counts its choices,
    # prompts x n; one is admitted while the count is under the cap). Ranks not listed are never shed:
    # realtime (0) keeps being served while standard (1) and batch (2) traffic is turned away, batch first.
    return {1: 1024, 2: 256}


@dataclass(slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # the `model` name clients use; defaults to the checkpoint dir name
    max_request_bytes: int = 4 * 2**20
    database_url: str = "sqlite:///./moegate.db"
    auth_cache_ttl_s: float = 5.0  # how long a revoked key may keep working
    policy_cache_ttl_s: float = 5.0  # how long a changed quota or a disabled tenant may take to apply
    drain_timeout_s: float = 30.0  # on SIGTERM/SIGINT: how long in-flight requests may run on
    # Connections: an idle one (none sent yet, or between requests) is closed after keepalive_timeout_s;
    # a request body must arrive within body_timeout_s; past max_connections new ones are closed at once.
    keepalive_timeout_s: float = 15.0
    body_timeout_s: float = 60.0
    max_connections: int = 4096
    # An engine replica whose restart failed (a remote engine not reachable yet, say) is tried again after
    # engine_restart_backoff_s, doubling up to engine_restart_backoff_max_s (see gateway.engine_supervisor).
    engine_restart_backoff_s: float = 5.0
    engine_restart_backoff_max_s: float = 60.0
    # /metrics carries tenant names: it is served on its own listener (metrics_port; the command line
    # defaults it to 9400 on loopback), and on the API's port only with ``Authorization: Bearer
    # <metrics_token>`` when a token is set. With neither, it is not served.
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    metrics_token: str | None = None
    # The operator's endpoints (/admin/...: load and unload LoRA adapters) exist only with this token set
    # (the command line reads MOEGATE_ADMIN_TOKEN), for ``Authorization: Bearer <admin_token>`` alone.
    admin_token: str | None = None
    max_inflight_by_priority: dict[int, int] = field(default_factory=_default_inflight_caps)
    # Output tokens reserved per choice at admission when a request sets no max_tokens (the OpenAI SDKs'
    # default for chat), instead of the whole context; the settle charges what was really generated.
    default_reservation_tokens: int = 512
    # Batch API
    data_dir: str = ".moegate/data"  # uploaded files and batch results (the database keeps the state)
    batch_max_file_bytes: int = 100 * 2**20
    batch_max_lines: int = 50_000
    batch_completion_window_s: float = 24 * 3600.0  # what "24h" means (shorter in tests)
    batch_lease_s: float = 60.0  # a crashed gateway's lines are taken over after this
    # Batch lines in the engine at once, from this gateway; None: twice the engine's max_num_seqs, so
    # lines queue inside the engine and take a slot the step after one frees (see gateway.batch.runner).
    batch_max_inflight: int | None = None
    batch_poll_s: float = 0.5
    # Responses API: how long a stored response (store: true, the default) can be continued with
    # previous_response_id or read back, before it is deleted.
    responses_retention_s: float = 30 * 24 * 3600.0
    # Chat output parsing: a name from gateway.tool_parsers (TOOL_PARSERS / REASONING_PARSERS), "auto" (from
    # the checkpoint's chat template and architecture) or None (off).
    tool_call_parser: str | None = "auto"
    reasoning_parser: str | None = "auto"
    # Browser pages of these origins may call the API (gateway.cors): "*" for any; empty: none (no CORS headers).
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if any(cap < 1 for cap in self.max_inflight_by_priority.values()):
            raise ValueError("max_inflight_by_priority caps must be >= 1")
        if self.policy_cache_ttl_s < 0 or self.auth_cache_ttl_s < 0 or self.drain_timeout_s < 0:
            raise ValueError("cache TTLs and drain_timeout_s must be >= 0")
        if self.batch_lease_s <= 0 or self.batch_poll_s <= 0 or self.batch_completion_window_s <= 0:
            raise ValueError("batch_lease_s, batch_poll_s and batch_completion_window_s must be > 0")
        if (self.batch_max_inflight is not None and self.batch_max_inflight < 1) or self.batch_max_lines < 1 or self.batch_max_file_bytes < 1:
            raise ValueError("batch_max_inflight, batch_max_lines and batch_max_file_bytes must be >= 1")
        if self.keepalive_timeout_s <= 0 or self.body_timeout_s <= 0 or self.max_connections < 1:
            raise ValueError("keepalive_timeout_s and body_timeout_s must be > 0, max_connections >= 1")
        if not 0 < self.engine_restart_backoff_s <= self.engine_restart_backoff_max_s:
            raise ValueError(f"engine_restart_backoff_s must be > 0 and at most engine_restart_backoff_max_s, got "
                             f"{self.engine_restart_backoff_s:g} and {self.engine_restart_backoff_max_s:g}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")
        if not self.responses_retention_s > 0:
            raise ValueError(f"responses_retention_s must be > 0, got {self.responses_retention_s:g}")
        if self.default_reservation_tokens < 1:
            raise ValueError("default_reservation_tokens must be >= 1")
        if self.max_request_bytes < 1024:
            raise ValueError("max_request_bytes must be at least 1024")
