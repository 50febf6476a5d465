"""Scenarios: who sends what, how fast, for how long. Loaded from YAML or JSON, or built from CLI flags.

A scenario file::

    base_url: http://127.0.0.1:8000/v1
    model: demo-model          # optional: sent as "model"
    duration: 60               # seconds; stops sending then (optional if every tenant has num_requests)
    seed: 0
    slo: ttft=500ms,tpot=50ms  # optional: goodput counts requests within every bound
    slo_by_priority:           # optional: a class's own bounds (by its priority label), in place of slo's
      realtime: ttft=500ms,itl=60ms
    warmup: 2                  # optional: requests per tenant sent one by one first, not measured
    defaults:                  # merged into every tenant
      dataset: {kind: synthetic, input_len: "uniform:16,512", output_len: "fixed:64"}
    tenants:
      - name: acme
        api_key: mg-...        # or api_key_env: ACME_KEY
        priority: realtime     # a label to group results by (the server decides the real class by key)
        weight: 2              # expected share of served tokens, for fairness
        arrival: poisson       # gamma | constant | concurrency | throughput
        rate: 4                # requests/s (concurrency: 8 for the closed loop)
        burstiness: 1
        ramp_to: 10            # optional ramp, with ramp_s
        num_requests: 200
        api: chat              # or completion
        stream: true
        max_tokens: 64         # overrides the dataset's output length
        ignore_eos: true
        honour_retry_after: true
        dataset: {kind: shared-prefix, num_prefixes: 4, prefix_len: 256, input_len: 32, output_len: 32}
      - name: nightly
        batch: {num_requests: 50, completion_window: 24h}   # a Batch API job (files + batches), timed to completion

All tenants start together.
"""

import json
import math
import os
from dataclasses import dataclass, field

from loadgen.arrivals import ArrivalConfig
from loadgen.client import RequestOptions, Target
from loadgen.datasets import DatasetConfig

_ARRIVAL_KEYS = {"arrival", "rate", "burstiness", "concurrency", "ramp_to", "ramp_s"}
_OPTION_KEYS = {"api", "stream", "max_tokens", "ignore_eos", "temperature", "extra_body", "honour_retry_after",
                "max_retries", "timeout_s"}
_TENANT_KEYS = {"name", "api_key", "api_key_env", "priority", "weight", "num_requests", "dataset", "batch"} | _ARRIVAL_KEYS | _OPTION_KEYS
_TOP_KEYS = {"base_url", "model", "duration", "seed", "slo", "slo_by_priority", "defaults", "tenants", "num_requests",
             "warmup"}


@dataclass(slots=True)
class BatchJobConfig:
    """A Batch API job: ``num_requests`` lines uploaded as one file, then polled until it ends."""

    num_requests: int = 10
    completion_window: str = "24h"
    poll_interval_s: float = 1.0
    timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.num_requests < 1 or not self.poll_interval_s > 0 or not self.timeout_s > 0:
            raise ValueError("batch needs num_requests >= 1, poll_interval_s > 0 and timeout_s > 0")


@dataclass(slots=True)
class TenantSpec:
    """One tenant's load. ``num_requests`` None: until the scenario's duration ends."""

    name: str
    api_key: str | None = None
    priority: str | None = None
    weight: float = 1.0
    arrival: ArrivalConfig = field(default_factory=lambda: ArrivalConfig("poisson", 1.0))
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    options: RequestOptions = field(default_factory=RequestOptions)
    num_requests: int | None = None
    batch: BatchJobConfig | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("every tenant needs a name")
        if not self.weight > 0:
            raise ValueError(f"tenant {self.name}: weight must be > 0")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"tenant {self.name}: num_requests must be >= 1")
        if self.dataset.images and self.options.api != "chat":
            raise ValueError(f"tenant {self.name}: images are sent in chat requests: set api chat (--api chat)")


@dataclass(slots=True)
class Scenario:
    """A whole run: tenants started together, bounded by their request counts and/or ``duration_s``."""

    target_url: str
    tenants: list[TenantSpec]
    duration_s: float | None = None
    seed: int = 0
    slo: dict[str, float] = field(default_factory=dict)
    model: str | None = None
    warmup: int = 0  # requests per tenant sent one at a time before the run, left out of the results
    slo_by_priority: dict[str, dict[str, float]] = field(default_factory=dict)  # a class's bounds, in place of slo's

    def __post_init__(self) -> None:
        if self.warmup < 0:
            raise ValueError("warmup must be >= 0")
        if not self.tenants:
            raise ValueError("a scenario needs at least one tenant")
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"tenant names must be unique, got {names}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError("duration must be > 0 seconds")
        for t in self.tenants:
            if t.batch is None and t.num_requests is None and self.duration_s is None:
                raise ValueError(f"tenant {t.name} has no num_requests and the scenario has no duration: it would never stop")
            if t.batch is None and t.arrival.process == "throughput" and t.num_requests is None:
                raise ValueError(f"tenant {t.name}: the throughput process needs num_requests")

    def target(self, tenant: TenantSpec) -> Target:
        return Target(self.target_url, tenant.api_key)


SLO_KEYS = ("ttft", "tpot", "itl", "e2e")


def parse_duration(text: str | float | int) -> float:
    """``500ms``, ``0.5s``, ``2m`` or a bare number of seconds -> seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    t = str(text).strip().lower()
    for suffix, scale in (("ms", 1e-3), ("us", 1e-6), ("s", 1.0), ("m", 60.0), ("h", 3600.0)):
        if t.endswith(suffix):
            try:
                return float(t[: -len(suffix)]) * scale
            except ValueError:
                break
    try:
        return float(t)
    except ValueError:
        raise ValueError(f"bad duration {text!r}: use e.g. 500ms, 2s, 5m") from None


def parse_slo(text: str | dict | None) -> dict[str, float]:
    """``ttft=500ms,tpot=50ms`` -> {"ttft": 0.5, "tpot": 0.05} (seconds). Keys: ttft, tpot, itl, e2e."""
    if not text:
        return {}
    items = text.items() if isinstance(text, dict) else (part.split("=", 1) for part in str(text).split(",") if part)
    slo = {}
    for item in items:
        if len(item) != 2:
            raise ValueError(f"bad SLO {text!r}: use e.g. ttft=500ms,tpot=50ms")
        key, value = item[0].strip().lower(), item[1]
        if key not in SLO_KEYS:
            raise ValueError(f"unknown SLO {key!r}: use {', '.join(SLO_KEYS)}")
        slo[key] = parse_duration(value)
        if not slo[key] > 0:
            raise ValueError(f"SLO {key} must be > 0")
    return slo


def tenant_from_dict(d: dict, model: str | None = None) -> TenantSpec:
    unknown = set(d) - _TENANT_KEYS
    if unknown:
        raise ValueError(f"tenant {d.get('name', '?')}: unknown keys {sorted(unknown)}")
    name = str(d.get("name", ""))
    key = d.get("api_key")
    if key is None and d.get("api_key_env"):
        key = os.environ.get(d["api_key_env"])
        if key is None:
            raise ValueError(f"tenant {name}: environment variable {d['api_key_env']} is not set")
    process = d.get("arrival") or ("concurrency" if "concurrency" in d else "poisson")
    rate = d.get("rate")
    arrival = ArrivalConfig(
        process, float(rate) if rate is not None else (1.0 if process not in ("concurrency", "throughput") else None),
        float(d.get("burstiness", 1.0)), d.get("concurrency"), d.get("ramp_to"),
        parse_duration(d["ramp_s"]) if "ramp_s" in d else None,
    )
    dataset = dict(d.get("dataset") or {})
    try:
        dataset_config = DatasetConfig(**dataset)
    except TypeError as e:
        raise ValueError(f"tenant {name}: bad dataset keys ({e})") from None
    options = RequestOptions(model=model, **{k: d[k] for k in _OPTION_KEYS if k in d})
    batch = None
    if d.get("batch") is not None:
        try:
            b = dict(d["batch"])
            if "poll_interval_s" in b:
                b["poll_interval_s"] = parse_duration(b["poll_interval_s"])
            batch = BatchJobConfig(**b)
        except TypeError as e:
            raise ValueError(f"tenant {name}: bad batch keys ({e})") from None
    return TenantSpec(name, key, d.get("priority"), float(d.get("weight", 1.0)), arrival, dataset_config, options,
                      d.get("num_requests"), batch)


def _merge(defaults: dict, tenant: dict) -> dict:
    merged = {**defaults, **tenant}
    if isinstance(defaults.get("dataset"), dict) and isinstance(tenant.get("dataset"), dict):
        merged["dataset"] = {**defaults["dataset"], **tenant["dataset"]}
    return merged


def scenario_from_dict(d: dict, base_url: str | None = None, duration_s: float | None = None,
                       seed: int | None = None) -> Scenario:
    """Build a scenario from its file form; CLI values, when given, override the file's."""
    if not isinstance(d, dict):
        raise ValueError("a scenario file holds a mapping with a 'tenants' list")
    unknown = set(d) - _TOP_KEYS
    if unknown:
        raise ValueError(f"scenario: unknown keys {sorted(unknown)}")
    tenants_raw = d.get("tenants")
    if not isinstance(tenants_raw, list) or not tenants_raw:
        raise ValueError("a scenario needs a non-empty 'tenants' list")
    defaults = d.get("defaults") or {}
    if "num_requests" in d:
        defaults = {"num_requests": d["num_requests"], **defaults}
    model = d.get("model")
    tenants = [tenant_from_dict(_merge(defaults, t), model) for t in tenants_raw]
    url = base_url or d.get("base_url")
    if not url:
        raise ValueError("the scenario needs base_url (in the file or --base-url)")
    duration = duration_s if duration_s is not None else (parse_duration(d["duration"]) if "duration" in d else None)
    if duration is not None and math.isinf(duration):
        duration = None
    by_priority = d.get("slo_by_priority") or {}
    if not isinstance(by_priority, dict):
        raise ValueError("slo_by_priority maps a priority label to its bounds, e.g. {realtime: ttft=500ms}")
    return Scenario(url, tenants, duration, int(seed if seed is not None else d.get("seed", 0)), parse_slo(d.get("slo")),
                    model, int(d.get("warmup", 0)), {str(k): parse_slo(v) for k, v in by_priority.items()})


def load_scenario(path: str, **overrides) -> Scenario:
    """Read a YAML (``.yaml``/``.yml``) or JSON scenario file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"cannot read scenario {path}: {e.strerror}") from None
    if path.endswith((".yaml", ".yml")):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
    return scenario_from_dict(data, **overrides)
