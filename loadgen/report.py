"""Reports on the console (rich tables), as JSON (the summary and every request's record) and as CSV.

``write_json`` is the one JSON writer for every loadgen command (online runs,
``sweep``, ``offline``, ``compare-batching``): the same envelope (tool,
command, machine, date) around each command's own body.
"""

import csv
import dataclasses
import datetime
import json
import math
import os
import platform
import sys

from rich.console import Console
from rich.table import Table

from loadgen.records import CSV_COLUMNS, csv_row


def machine_info() -> dict:
    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}


def _clean(obj):
    """JSON-safe: NaN/inf become null (strict JSON has no such numbers)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_json(path: str, kind: str, body: dict) -> None:
    """Write ``body`` under the common envelope to ``path`` (parent directories are created)."""
    payload = {
        "tool": "moegate loadgen", "kind": kind, "command": " ".join(sys.argv),
        "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), **body,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_clean(payload), f, indent=1)


def scenario_dict(scenario) -> dict:
    """The scenario as data, with API keys redacted (a report gets shared; keys must not travel with it)."""
    d = dataclasses.asdict(scenario)
    for t in d["tenants"]:
        if t.get("api_key"):
            t["api_key"] = "<redacted>"
    return d


def run_body(result) -> dict:
    return {"started_at": result.started_at, "duration_s": result.duration_s, "scenario": scenario_dict(result.scenario),
            "analysis": result.analysis, "records": [r.to_dict() for r in result.records]}


def write_run_json(path: str, result) -> None:
    write_json(path, "run", run_body(result))


def write_csv(path: str, records) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for r in records:
            writer.writerow(csv_row(r))


def _ms(stats: dict | None, key: str) -> str:
    return "-" if not stats else f"{stats[key] * 1000:.0f}" if stats[key] >= 0.01 else f"{stats[key] * 1000:.1f}"


def _pair(stats: dict | None) -> str:
    return "-" if not stats else f"{_ms(stats, 'p50')} / {_ms(stats, 'p99')}"


def summary_table(title: str, groups: dict[str, dict], with_goodput: bool) -> Table:
    """One row per group (the run, a tenant, a priority class)."""
    table = Table(title=title, title_justify="left")
    cols = ["group", "ok / sent", "req/s", "out tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "ITL p50/p99 ms",
            "E2E p50/p99 ms", "429s", "errors"]
    if with_goodput:
        cols.insert(4, "goodput req/s (attained)")
        cols.insert(5, "goodput tok/s")
    for c in cols:
        table.add_column(c, justify="left" if c == "group" else "right")
    for name, s in groups.items():
        lat = s["latency_s"]
        errors = ", ".join(f"{k}: {v}" for k, v in s["errors_by_status"].items()) or "-"
        row = [name, f"{s['ok']} / {s['requests']}", f"{s['request_throughput']:.2f}",
               f"{s['output_token_throughput']:.1f}", _pair(lat["ttft"]), _pair(lat["tpot"]), _pair(lat["itl"]),
               _pair(lat["e2e"]), str(s["http_429"]), errors]
        if with_goodput:
            judged = s.get("attainment") is not None
            row.insert(4, f"{s['goodput']:.2f} ({100 * s['attainment']:.0f}%)" if judged else "-")
            row.insert(5, f"{s['goodput_token_throughput']:.1f}" if judged else "-")
        table.add_row(*row)
    return table


def report_console() -> Console:
    # Piped into a file or a CI log, rich would wrap at 80 columns and break the wide tables.
    return Console() if sys.stdout.isatty() else Console(width=200)


def print_run_summary(result, console: Console | None = None) -> None:
    """The console report of an online run."""
    console = console or report_console()
    a = result.analysis
    sc = result.scenario
    slo = a["slo_s"]
    console.print(f"[bold]moegate loadgen[/bold] against {sc.target_url}: {len(sc.tenants)} tenant(s), "
                  f"{a['overall']['requests']} requests in {result.duration_s:.1f} s (seed {sc.seed})")
    for t in sc.tenants:
        what = f"batch job of {t.batch.num_requests}" if t.batch else t.arrival.describe()
        console.print(f"  {t.name}: {what}; {t.dataset.describe()}; {t.options.api}, "
                      f"{'stream' if t.options.stream else 'no stream'}" + (f"; class {t.priority}" if t.priority else ""))
    if slo:
        console.print("  SLO: " + ", ".join(f"{k} <= {v * 1000:g} ms" for k, v in slo.items()))
    for cls, bounds in a.get("slo_by_priority_s", {}).items():
        console.print(f"  SLO of class {cls}: " + ", ".join(f"{k} <= {v * 1000:g} ms" for k, v in bounds.items()))
    groups = {"all": a["overall"]}
    if len(a["tenants"]) > 1:
        groups.update({f"tenant {k}": v for k, v in a["tenants"].items()})
    groups.update({f"class {k}": v for k, v in a["priorities"].items()})
    console.print(summary_table("Requests", groups, bool(slo or a.get("slo_by_priority_s"))))
    o = a["overall"]
    if o["cached_tokens"] or o["retries"] or o["retry_after_s"]:
        ra = o["retry_after_s"]
        console.print(f"cached prompt tokens: {o['cached_tokens']} of {o['prompt_tokens']}"
                      + (f"; Retry-After seen {ra['count']}x (min {ra['min']:g} s, max {ra['max']:g} s), "
                         f"retries {o['retries']}" if ra else ""))
    images = a.get("images")
    if images:
        new, repeated, share = images["ttft_new_s"], images["ttft_repeated_s"], images["encoder_share"]
        line = f"images: {images['images']} sent, {images['new_images']} new"
        if new:
            line += f"; TTFT p50 {new['p50'] * 1000:.0f} ms with a new image ({new['count']} requests)"
        if repeated:
            line += f", {repeated['p50'] * 1000:.0f} ms with repeated images only ({repeated['count']})"
        if share is not None:
            line += f"; the encoder's share of TTFT: ~{100 * share:.0f}% (mean TTFT, new vs repeated)"
        console.print(line)
    fair = a["fairness"]
    if len(fair["tenants"]) > 1:
        table = Table(title="Fairness (served tokens = prompt + completion of answered requests)", title_justify="left")
        for c in ("tenant", "weight", "served tokens", "share", "weight share", "share / weight share"):
            table.add_column(c, justify="left" if c == "tenant" else "right")
        for name, f in fair["tenants"].items():
            table.add_row(name, f"{f['weight']:g}", str(f["served_tokens"]), f"{100 * f['share']:.1f}%",
                          f"{100 * f['weight_share']:.1f}%", f"{f['normalized_share']:.2f}")
        console.print(table)
        jain = fair["jain_index"]
        per_class = ", ".join(f"{p}: {j:.3f}" for p, j in fair["by_priority"].items() if j is not None)
        console.print(f"Jain's fairness index: {jain:.3f}" if jain is not None else "Jain's fairness index: -",
                      f"(by class: {per_class})" if per_class else "")
    for job in result.batch_jobs:
        line = (f"batch job {job['tenant']}: {job['num_requests']} requests, status {job['status']}, "
                f"turnaround {job['turnaround_s']:.1f} s" if job["turnaround_s"] is not None else
                f"batch job {job['tenant']}: {job['error']}")
        if job.get("completed_lines") is not None:
            line += f", {job['completed_lines']} lines ok, {job['completion_tokens']} completion tokens"
        console.print(line)


def print_table(title: str, columns: list[str], rows: list[list], console: Console | None = None) -> None:
    """A plain table (offline and compare-batching reports)."""
    table = Table(title=title, title_justify="left")
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*[str(x) for x in row])
    (console or report_console()).print(table)


def markdown_table(columns: list[str], rows: list[list]) -> str:
    """The same table as Markdown, for docs/performance.md."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(["---"] + ["---:"] * (len(columns) - 1)) + "|"]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)
