"""SQLAlchemy ORM models of the tenants schema.

The schema itself is created by the Alembic migrations in ``migrations/``;
these classes must match them (a test compares the two). Timestamps are naive
UTC datetimes on every backend, so SQLite and PostgreSQL read back the same
values.
"""

from __future__ import annotations

from datetime import date, datetime, timezone

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Date,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from tenants.keys import new_secret

# SQLite only auto-increments an INTEGER PRIMARY KEY; PostgreSQL gets a 64-bit id.
BigId = BigInteger().with_variant(Integer, "sqlite")


# Column lengths the API checks before writing (PostgreSQL refuses a longer value; SQLite would keep it).
MAX_FILENAME_CHARS = 512  # an uploaded file's name
MAX_CUSTOM_ID_CHARS = 512  # a Batch API line's custom_id


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


class Base(DeclarativeBase):
    pass


class PriorityClass(Base):
    __tablename__ = "priority_classes"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    # The column keeps its first name (``rank``); everywhere above the database it is ``priority``.
    priority: Mapped[int] = mapped_column("rank", Integer, nullable=False)
    default_weight: Mapped[float] = mapped_column(Float, nullable=False, default=1.0)
    preemptible: Mapped[bool] = mapped_column(Boolean, nullable=False)
    may_preempt: Mapped[bool] = mapped_column(Boolean, nullable=False)
    # Service-level objectives (``tenants.policy.ClassInfo``): time to first token and mean time between tokens,
    # milliseconds (NULL: none), and what admission does with a request predicted to miss the first: refuse or queue.
    ttft_slo_ms: Mapped[int | None] = mapped_column(Integer)
    itl_slo_ms: Mapped[int | None] = mapped_column(Integer)
    slo_action: Mapped[str] = mapped_column(String(8), nullable=False, default="queue", server_default="queue")

    __table_args__ = (
        CheckConstraint("rank >= 0", name="ck_priority_classes_rank"),
        CheckConstraint("default_weight > 0", name="ck_priority_classes_weight"),
        CheckConstraint("ttft_slo_ms IS NULL OR ttft_slo_ms > 0", name="ck_priority_classes_ttft_slo_ms"),
        CheckConstraint("itl_slo_ms IS NULL OR itl_slo_ms > 0", name="ck_priority_classes_itl_slo_ms"),
        CheckConstraint("slo_action IN ('refuse', 'queue')", name="ck_priority_classes_slo_action"),
    )


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128), nullable=False, unique=True)
    priority_class: Mapped[str] = mapped_column(
        String(64), ForeignKey("priority_classes.name", onupdate="CASCADE"), nullable=False
    )
    weight: Mapped[float] = mapped_column(Float, nullable=False)
    status: Mapped[str] = mapped_column(String(16), nullable=False, default="active")
    created_at: Mapped[datetime] = mapped_column(DateTime, nullable=False, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime, nullable=False, default=utcnow, onupdate=utcnow)
    # Salts the tenant's prefix-cache blocks (``RequestPolicy.cache_salt``): random, secret (never shown by the API
    # or the CLI) and never reused, unlike ``id``, which another database hands out again.
    cache_salt: Mapped[str] = mapped_column(String(64), nullable=False, default=new_secret)

    __table_args__ = (
        CheckConstraint("status IN ('active', 'disabled')", name="ck_tenants_status"),
        CheckConstraint("weight > 0", name="ck_tenants_weight"),
        UniqueConstraint("cache_salt", name="uq_tenants_cache_salt"),
    )


class Deployment(Base):
    """One row: this database's random identity. Engines' disk prefix-cache tiers record it and never read files
    written under another (a new or restored database, another server's)."""

    __tablename__ = "deployment"

    id: Mapped[str] = mapped_column(String(64), primary_key=True, default=new_secret)
    created_at: Mapped[datetime] = mapped_column(DateTime, nullable=False, default=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False, index=True)
    label: Mapped[str | None] = mapped_column(String(128))
    prefix: Mapped[str] = mapped_column(String(8), nullable=False)
    key_hash: Mapped[str] = mapped_column(String(64), nullable=False, unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, nullable=False, default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime)  # None: never


QUOTA_LIMIT_FIELDS = (
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrency",
    "max_tokens_per_request",
    "daily_tokens",
    "monthly_tokens",
    "max_batch_queue_tokens",
    "max_stored_file_bytes",
    "stored_response_bytes",
    "max_images_per_request",
    "max_image_pixels",
)
# A tenant's stored files (/v1/files) may take this many bytes unless its quota says otherwise (NULL: no cap).
DEFAULT_MAX_STORED_FILE_BYTES = 2**30
# Bytes of stored Responses API responses a tenant may keep (its unexpired rows' ``stored_bytes``) unless its
# quota says otherwise; the default of new tenants' quotas and of migrated ones.
DEFAULT_STORED_RESPONSE_BYTES = 256 * 2**20


class Quota(Base):
    """One row per tenant; a NULL limit means unlimited."""

    __tablename__ = "quotas"

    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    requests_per_minute: Mapped[int | None] = mapped_column(BigInteger)
    tokens_per_minute: Mapped[int | None] = mapped_column(BigInteger)
    max_concurrency: Mapped[int | None] = mapped_column(BigInteger)
    max_tokens_per_request: Mapped[int | None] = mapped_column(BigInteger)
    daily_tokens: Mapped[int | None] = mapped_column(BigInteger)
    monthly_tokens: Mapped[int | None] = mapped_column(BigInteger)
    max_batch_queue_tokens: Mapped[int | None] = mapped_column(BigInteger)
    batch_discount: Mapped[float] = mapped_column(Float, nullable=False, default=0.5)
    cache_share: Mapped[float | None] = mapped_column(Float)  # of the prefix-cache tiers; NULL: shared LRU
    max_stored_file_bytes: Mapped[int | None] = mapped_column(
        BigInteger, default=DEFAULT_MAX_STORED_FILE_BYTES, server_default=str(DEFAULT_MAX_STORED_FILE_BYTES))
    stored_response_bytes: Mapped[int | None] = mapped_column(BigInteger, default=DEFAULT_STORED_RESPONSE_BYTES)
    # Images per chat request and decoded pixels per image; NULL: the gateway's own limits (its flags). A tenant's
    # limit only ever tightens the gateway's (``gateway.chat_images.ImageLimits.for_tenant``).
    max_images_per_request: Mapped[int | None] = mapped_column(BigInteger)
    max_image_pixels: Mapped[int | None] = mapped_column(BigInteger)

    __table_args__ = tuple(
        CheckConstraint(f"{f} IS NULL OR {f} >= 0", name=f"ck_quotas_{f}") for f in QUOTA_LIMIT_FIELDS
    ) + (CheckConstraint("batch_discount >= 0 AND batch_discount <= 1", name="ck_quotas_batch_discount"),
         CheckConstraint("cache_share IS NULL OR (cache_share > 0 AND cache_share <= 1)", name="ck_quotas_cache_share"))


class Usage(Base):
    """One row per finished request: the ledger that budgets and billing sum over."""

    __tablename__ = "usage"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False)
    key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id", ondelete="SET NULL"))
    request_id: Mapped[str] = mapped_column(String(64), nullable=False)
    model: Mapped[str] = mapped_column(String(256), nullable=False)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False)
    cached_prompt_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False)
    billed_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False)
    batch: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    http_status: Mapped[int] = mapped_column(Integer, nullable=False, default=200)
    adapter: Mapped[str | None] = mapped_column(String(128))  # the LoRA adapter the request ran under; NULL: base
    # The priority class the request ran in, and whether it met that class's objectives (NULL: the class had none,
    # or the row predates them): the ledger's goodput and attainment.
    priority_class: Mapped[str | None] = mapped_column(String(64))
    slo_met: Mapped[bool | None] = mapped_column(Boolean)
    started_at: Mapped[datetime] = mapped_column(DateTime, nullable=False)
    finished_at: Mapped[datetime] = mapped_column(DateTime, nullable=False)
    # The UTC day of finished_at, stored so per-tenant per-day queries use an index on both backends.
    day: Mapped[date] = mapped_column(Date, nullable=False)

    __table_args__ = (
        Index("ix_usage_tenant_day", "tenant_id", "day"),
        Index("ix_usage_day", "day"),
    )


class QuotaCounter(Base):
    """A running total for one tenant, kind and window (epoch seconds of the window start).

    Kinds: ``rpm``/``tpm`` (per-minute fixed windows), ``conc`` (window 0, in-flight
    requests), ``day``/``month`` (billed tokens incl. open reservations), ``bq``
    (queued batch tokens, window 0). Only ever changed by one atomic upsert.
    """

    __tablename__ = "quota_counters"

    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    kind: Mapped[str] = mapped_column(String(8), primary_key=True)
    window: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger, nullable=False)


class StoredFile(Base):
    """An uploaded (or produced) file; its bytes are its ``FileChunk`` rows (``path`` empty), or, for files
    written before they moved into the database, a file under the gateway's data directory."""

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # "file-..."
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False)
    filename: Mapped[str] = mapped_column(String(MAX_FILENAME_CHARS), nullable=False)
    purpose: Mapped[str] = mapped_column(String(32), nullable=False)
    bytes: Mapped[int] = mapped_column(BigInteger, nullable=False)
    path: Mapped[str] = mapped_column(String(1024), nullable=False)  # relative to the data directory; "" in the database
    created_at: Mapped[datetime] = mapped_column(DateTime, nullable=False, default=utcnow)

    __table_args__ = (Index("ix_files_tenant_created", "tenant_id", "created_at"),)


class FileChunk(Base):
    """Up to ``FILE_CHUNK_BYTES`` of a file's content, in ``seq`` order; removed with the file."""

    __tablename__ = "file_chunks"

    file_id: Mapped[str] = mapped_column(ForeignKey("files.id", ondelete="CASCADE"), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)


FILE_CHUNK_BYTES = 1 << 20


BATCH_STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                  "cancelled")
LINE_STATUSES = ("pending", "running", "done", "failed", "expired", "cancelled")


class Batch(Base):
    """One batch job. Its lines are ``BatchLine`` rows; times are naive UTC."""

    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # "batch_..."
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False)
    endpoint: Mapped[str] = mapped_column(String(64), nullable=False)
    input_file_id: Mapped[str] = mapped_column(String(64), nullable=False)
    completion_window: Mapped[str] = mapped_column(String(16), nullable=False)
    status: Mapped[str] = mapped_column(String(16), nullable=False)
    model: Mapped[str | None] = mapped_column(String(256))
    metadata_json: Mapped[str | None] = mapped_column(String)
    errors_json: Mapped[str | None] = mapped_column(String)
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    total: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    completed: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    failed: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    queued_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)  # held on the queue limit
    # Who finalizes (writes the output files), and until when: a crashed finalizer's lease runs out.
    lease_owner: Mapped[str | None] = mapped_column(String(64))
    lease_expires: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime, nullable=False, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(DateTime, nullable=False)
    in_progress_at: Mapped[datetime | None] = mapped_column(DateTime)
    finalizing_at: Mapped[datetime | None] = mapped_column(DateTime)
    completed_at: Mapped[datetime | None] = mapped_column(DateTime)
    failed_at: Mapped[datetime | None] = mapped_column(DateTime)
    expired_at: Mapped[datetime | None] = mapped_column(DateTime)
    cancelling_at: Mapped[datetime | None] = mapped_column(DateTime)
    cancelled_at: Mapped[datetime | None] = mapped_column(DateTime)

    __table_args__ = (
        Index("ix_batches_tenant_created", "tenant_id", "created_at"),
        Index("ix_batches_status", "status"),
        CheckConstraint("status IN (%s)" % ", ".join(f"'{s}'" for s in BATCH_STATUSES), name="ck_batches_status"),
    )


class BatchLine(Base):
    """One request line of a batch: claimed with an expiring lease, finished exactly once."""

    __tablename__ = "batch_lines"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"), nullable=False)
    line_no: Mapped[int] = mapped_column(Integer, nullable=False)
    custom_id: Mapped[str] = mapped_column(String(MAX_CUSTOM_ID_CHARS), nullable=False)
    body_json: Mapped[str] = mapped_column(String, nullable=False)
    status: Mapped[str] = mapped_column(String(16), nullable=False, default="pending")
    lease_owner: Mapped[str | None] = mapped_column(String(64))
    lease_expires: Mapped[float | None] = mapped_column(Float)  # epoch seconds
    attempts: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    result_json: Mapped[str | None] = mapped_column(String)  # the output (or error) file line, once finished

    __table_args__ = (
        Index("ux_batch_lines_custom_id", "batch_id", "custom_id", unique=True),
        Index("ix_batch_lines_claim", "status", "batch_id", "line_no"),
        CheckConstraint("status IN (%s)" % ", ".join(f"'{s}'" for s in LINE_STATUSES), name="ck_batch_lines_status"),
    )


class StoredResponse(Base):
    """A Responses API response kept for ``previous_response_id`` and ``GET /v1/responses/{id}`` until
    ``expires_at`` (the gateway's retention, moved on while a later response continues it). A conversation is
    a chain: each row holds its own input items (``input_json``: those its request sent, not the earlier
    responses') and its output (in ``response_json``), and names the response it continued (``parent_id``);
    ``stored_bytes`` is what the row holds, counted against the tenant's ``stored_response_bytes``."""

    __tablename__ = "responses"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # "resp_..."
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False)
    parent_id: Mapped[str | None] = mapped_column(String(64))  # the previous_response_id it continued
    response_json: Mapped[str] = mapped_column(String, nullable=False)
    input_json: Mapped[str] = mapped_column(String, nullable=False)
    stored_bytes: Mapped[int] = mapped_column(BigInteger, nullable=False)
    created_at: Mapped[datetime] = mapped_column(DateTime, nullable=False, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(DateTime, nullable=False)

    __table_args__ = (Index("ix_responses_expires", "expires_at"), Index("ix_responses_tenant", "tenant_id"))


class Adapter(Base):
    """A LoRA adapter directory served under ``name`` (a request's ``model``): owned by one tenant, or public
    (``owner_tenant_id`` NULL); others use it through ``AdapterGrant`` rows. ``rank``, ``target_modules`` (comma
    separated) and ``base_model`` summarise the directory as checked when it was added."""

    __tablename__ = "adapters"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128), nullable=False, unique=True)
    path: Mapped[str] = mapped_column(String(1024), nullable=False)
    owner_tenant_id: Mapped[int | None] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer, nullable=False)
    target_modules: Mapped[str] = mapped_column(String(512), nullable=False)
    base_model: Mapped[str | None] = mapped_column(String(1024))
    created_at: Mapped[datetime] = mapped_column(DateTime, nullable=False, default=utcnow)

    __table_args__ = (CheckConstraint("rank > 0", name="ck_adapters_rank"),)


class AdapterGrant(Base):
    """Tenant ``tenant_id`` may use adapter ``adapter_id`` (besides its owner); gone with either."""

    __tablename__ = "adapter_grants"

    adapter_id: Mapped[int] = mapped_column(ForeignKey("adapters.id", ondelete="CASCADE"), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, nullable=False, default=utcnow)

    __table_args__ = (Index("ix_adapter_grants_tenant", "tenant_id"),)
