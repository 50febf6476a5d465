"""The gateway's typed config."""

from dataclasses import dataclass, field

from tenants.db import DEFAULT_DATABASE_URL

# The most pixels the engine decodes an image to (engine.vision.prompt_images.DEFAULT_MAX_DECODED_PIXELS; a test
# keeps the two equal): the gateway's own limit cannot be more.
MAX_DECODED_PIXELS = 64 * 1024 * 1024


def _default_inflight_caps() -> dict[int, int]:
    # rank -> most engine sequences in flight (queued in the engine or running; a request counts its choices,
    # prompts x n; one is admitted while the count is under the cap). Ranks not listed are never shed:
    # realtime (0) keeps being served while standard (1) and batch (2) traffic is turned away, batch first.
    return {1: 1024, 2: 256}


@dataclass(slots=True)
class GatewayConfig:
    """Everything a user may set about the gateway: each field but ``NOT_FLAGS``' (``gateway.cli.gateway_flags``)
    is a flag of ``moegate serve``, its help the string under the field. A name in double backquotes there is
    another field; the help shows its flag."""

    host: str = "127.0.0.1"
    """address the API listens on"""
    port: int = 8000
    """port the API listens on"""
    served_model_name: str | None = None
    """the ``model`` name clients use (default: the checkpoint directory's name)"""
    max_request_bytes: int = 4 * 2**20
    """largest request body, in bytes"""
    database_url: str = DEFAULT_DATABASE_URL
    """policy database: sqlite:///PATH or postgresql://..."""
    auth_cache_ttl_s: float = 5.0
    """seconds a revoked key may keep working"""
    policy_cache_ttl_s: float = 5.0
    """seconds a changed quota or a disabled tenant may take to apply"""
    drain_timeout_s: float = 30.0
    """seconds in-flight requests may run on after SIGTERM/SIGINT"""
    keepalive_timeout_s: float = 15.0
    """seconds an idle connection (nothing sent yet, or between requests) stays open"""
    body_timeout_s: float = 60.0
    """seconds a request body may take to arrive; slower ones get a 408"""
    max_connections: int = 4096
    """open connections at most; past it new ones are closed at once"""
    engine_restart_backoff_s: float = 5.0
    """an engine replica whose restart failed (a remote engine not reachable yet, say) is tried again after this
    many seconds, doubling each time up to ``engine_restart_backoff_max_s`` (``gateway.engine_supervisor``)"""
    engine_restart_backoff_max_s: float = 60.0
    """the longest wait, in seconds, between failed restarts of an engine replica"""
    # /metrics carries tenant names: it is served on its own listener (metrics_port; None: none, the command
    # line's default is 9400 on loopback), and on the API's port only with ``Authorization: Bearer
    # <metrics_token>`` when a token is set. With neither, it is not served.
    metrics_host: str = "127.0.0.1"
    """address of the /metrics listener: the series name tenants"""
    metrics_port: int | None = None
    """port of the /metrics listener; with MOEGATE_METRICS_TOKEN set, /metrics is also served on the API port to
    'Authorization: Bearer <token>'"""
    metrics_token: str | None = None
    """the token that reads /metrics on the API port (the command line reads MOEGATE_METRICS_TOKEN)"""
    admin_token: str | None = None
    """the operator's endpoints (/admin/...: load and unload LoRA adapters) exist only with this token set (the
    command line reads MOEGATE_ADMIN_TOKEN), for ``Authorization: Bearer <admin_token>`` alone"""
    max_inflight_by_priority: dict[int, int] = field(default_factory=_default_inflight_caps)
    """priority rank -> most engine sequences in flight past which its requests are shed (a 503)"""
    default_reservation_tokens: int = 512
    """output tokens a request without max_tokens reserves per choice against its tenant's token limits (not the
    whole context: the OpenAI SDKs send none for chat); what it really generates is charged when it ends"""
    data_dir: str = ".moegate/data"
    """Batch API files: uploads and results (the database keeps the state)"""
    batch_max_file_bytes: int = 100 * 2**20
    """largest Batch API input file, in bytes"""
    batch_max_lines: int = 50_000
    """most requests in one Batch API input file"""
    batch_completion_window_s: float = 24 * 3600.0
    """what a batch's "24h" completion window means, in seconds (shorter in tests)"""
    batch_lease_s: float = 60.0
    """seconds after which a crashed gateway's batch lines are taken over"""
    batch_max_inflight: int | None = None
    """batch lines in the engine at once, from this gateway (default: twice the engine's --max-num-seqs, so lines
    queue inside the engine and take a slot the step after one frees) (``gateway.batch.runner``)"""
    batch_poll_s: float = 0.5
    """seconds between looks for batch lines to run"""
    responses_retention_s: float = 30 * 24 * 3600.0
    """how long a stored Responses API response (store: true, the default) can be continued
    (previous_response_id) or read back before it is deleted"""
    tool_call_parser: str | None = "auto"
    """how tool calls are read from chat output: hermes (Qwen, <tool_call>{...}</tool_call>), mistral
    ([TOOL_CALLS][...]), ...; auto: from the checkpoint's chat template and architecture; none: off (None)"""
    reasoning_parser: str | None = "auto"
    """move <think>...</think> into reasoning_content: qwen3, ...; auto: when the chat template uses <think>;
    none: off (None)"""
    allowed_origins: tuple[str, ...] = ()
    """browser pages of these origins may call the API (CORS): scheme://host[:port] separated by commas, or * for
    any; preflight requests need no API key (default: none, no CORS headers) (``gateway.cors``)"""
    allowed_media_domains: tuple[str, ...] = ()
    """hosts whose http(s) image URLs the gateway fetches (chat image_url, Responses input_image): names separated
    by commas, *.example.com for any name under example.com; only from public addresses (default: none, remote
    image URLs are refused) (``gateway.remote_images``)"""
    media_fetch_timeout_s: float = 10.0
    """seconds a request's remote images may take to arrive, all together; a slower one is a 400"""
    allow_private_media_addresses: bool = False
    """DANGEROUS: fetch image URLs from loopback, link-local and private addresses too, so any client could make
    the gateway read from the machine itself and its network (metadata services, admin ports); for tests, or a
    closed network whose clients are all trusted"""
    max_images_per_request: int = 16
    """images one chat request may carry (image_url parts; the Responses API's input_image parts; Batch API
    lines); more is a 400 naming the first part past it. A tenant's quota may set fewer (moegate admin quota set
    NAME --max-images-per-request N)"""
    max_image_pixels: int = 4096 * 4096
    """decoded pixels (width x height) one image may have, read from its header before it is decoded; at most
    67108864 (the engine's own limit). A tenant's quota may set fewer (moegate admin quota set NAME
    --max-image-pixels N)"""

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
        if not self.media_fetch_timeout_s > 0:
            raise ValueError(f"media_fetch_timeout_s must be > 0, got {self.media_fetch_timeout_s:g}")
        if self.max_images_per_request < 0:
            raise ValueError(f"max_images_per_request must be >= 0, got {self.max_images_per_request}")
        if not 0 < self.max_image_pixels <= MAX_DECODED_PIXELS:
            raise ValueError(f"max_image_pixels must be in 1..{MAX_DECODED_PIXELS} (the engine decodes no larger "
                             f"image), got {self.max_image_pixels}")
        if self.max_request_bytes < 1024:
            raise ValueError("max_request_bytes must be at least 1024")
        from gateway.tool_parsers import REASONING_PARSERS, TOOL_PARSERS  # the parsers' modules: only when built

        for name, known in (("tool_call_parser", TOOL_PARSERS), ("reasoning_parser", REASONING_PARSERS)):
            value = getattr(self, name)
            if value is not None and value != "auto" and value not in known:
                raise ValueError(f"{name} must be 'auto', None (off) or one of {', '.join(sorted(known))}; "
                                 f"got {value!r}")
