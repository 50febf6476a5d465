"""One record per request: what was asked, when each thing happened, what came back.

Times are seconds from the start of the run (one monotonic clock). Latencies
are measured from the first send, so time spent waiting out a ``Retry-After``
and retrying counts: it is what the caller feels.

- ``queue_s``: scheduled arrival -> first send (the load generator's own lag;
  near 0 unless the client machine is saturated).
- ``qtfb_s`` (queue to first byte): scheduled arrival -> first response byte.
- ``ttft_s``: first send -> first chunk with content (the whole response when
  not streaming).
- ``itl_s``: gaps between successive content chunks.
- ``tpot_s``: (e2e - ttft) / (completion tokens - 1), as vLLM and genai-perf define it.
- ``e2e_s``: first send -> last byte.
"""

from dataclasses import asdict, dataclass, field, fields


@dataclass(slots=True)
class RequestRecord:
    """One request's measurements (see the module docstring for the latency definitions)."""

    index: int
    tenant: str
    priority: str | None = None
    scheduled_s: float = 0.0
    sent_s: float | None = None
    first_byte_s: float | None = None
    first_token_s: float | None = None
    end_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    input_len: int = 0  # the dataset's intended prompt length
    max_tokens: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    cached_tokens: int | None = None
    usage_source: str = "none"  # "usage" (server-reported) or "chunks" (counted from content chunks)
    status: int = 0  # HTTP status of the last attempt; 0: no response (connection error, timeout)
    ok: bool = False
    error: str | None = None
    retries: int = 0
    attempt_statuses: list[int] = field(default_factory=list)  # the HTTP status of every attempt that got a response
    retry_after_s: list[float] = field(default_factory=list)  # Retry-After values seen, in seconds
    ratelimit: dict[str, str] = field(default_factory=dict)  # x-ratelimit-* headers of the last response
    finish_reason: str | None = None
    images: int = 0  # image parts sent with the request
    new_images: int = 0  # of them, images the tenant had not sent before (the rest repeat earlier ones)

    # ---- derived latencies (None when the request never got that far) ----
    @property
    def queue_s(self) -> float | None:
        return None if self.sent_s is None else self.sent_s - self.scheduled_s

    @property
    def qtfb_s(self) -> float | None:
        return None if self.first_byte_s is None else self.first_byte_s - self.scheduled_s

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None or self.sent_s is None else self.first_token_s - self.sent_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_s is None or self.sent_s is None or not self.ok else self.end_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.completion_tokens < 2 or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    @property
    def served_tokens(self) -> int:
        """Tokens the server did work for: prompt + completion of a request that got a 200."""
        if self.status != 200:
            return 0
        return (self.prompt_tokens or 0) + self.completion_tokens

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in ("queue_s", "qtfb_s", "ttft_s", "e2e_s", "tpot_s"):
            d[name] = getattr(self, name)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "RequestRecord":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


CSV_COLUMNS = [
    "index", "tenant", "priority", "status", "ok", "error", "retries", "scheduled_s", "sent_s", "queue_s", "qtfb_s",
    "ttft_s", "tpot_s", "e2e_s", "itl_mean_s", "itl_max_s", "input_len", "max_tokens", "prompt_tokens",
    "completion_tokens", "cached_tokens", "usage_source", "finish_reason", "retry_after_s", "images", "new_images",
]


def csv_row(record: RequestRecord) -> dict:
    """A flat row for CSV (ITLs summarised; the JSON keeps them all)."""
    d = record.to_dict()
    itl = record.itl_s
    d["itl_mean_s"] = sum(itl) / len(itl) if itl else None
    d["itl_max_s"] = max(itl) if itl else None
    d["retry_after_s"] = ";".join(f"{v:g}" for v in record.retry_after_s)
    return {k: d.get(k) for k in CSV_COLUMNS}
