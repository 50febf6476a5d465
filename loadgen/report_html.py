"""Self-contained HTML reports (plotly, its JavaScript inlined: the file opens offline, anywhere).

Every page is built from the same data the JSON report holds, so
``moegate loadgen report results.json`` rebuilds a page from a saved run.
"""

import html

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from loadgen.records import RequestRecord

# Colour-blind-safe qualitative palette (Okabe-Ito), one colour per tenant/strategy.
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000"]

_CSS = """
body { font-family: -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; margin: 24px 32px; color: #222; }
h1 { font-size: 24px; margin-bottom: 4px; } h2 { font-size: 18px; margin-top: 28px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
.meta { color: #555; font-size: 13px; margin: 2px 0; }
.cards { display: flex; gap: 12px; flex-wrap: wrap; margin: 16px 0; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 10px 14px; flex: 1 1 0; min-width: 120px; background: #fafafa; }
.card .v { font-size: 22px; font-weight: 600; } .card .k { font-size: 12px; color: #666; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
th, td { border-bottom: 1px solid #e5e5e5; padding: 5px 10px; text-align: right; white-space: nowrap; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; }
.note { font-size: 12px; color: #666; max-width: 1100px; }
.bad { color: #b00020; font-weight: 600; }
.grid { display: grid; grid-template-columns: repeat(3, max-content); gap: 8px 28px; font-size: 13px; }
"""


def _page(title: str, body: list[str]) -> str:
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style>"
        f"<script type='text/javascript'>{get_plotlyjs()}</script></head><body>"
        + "\n".join(body) + "</body></html>"
    )


def _fig_html(fig: go.Figure, height: int = 420) -> str:
    # The legend sits to the right: above the plot it would collide with subplot titles.
    fig.update_layout(height=height, template="plotly_white", margin=dict(l=60, r=20, t=50, b=50),
                      legend=dict(orientation="v", yanchor="top", y=1, xanchor="left", x=1.02), font=dict(size=13))
    return fig.to_html(full_html=False, include_plotlyjs=False, config={"displaylogo": False})


def _ms(stats: dict | None, key: str) -> str:
    if not stats:
        return "-"
    ms = stats[key] * 1000
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.1f}"


def _table(columns: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{x}</td>" for x in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def _summary_rows(groups: dict[str, dict], with_goodput: bool) -> list[list]:
    rows = []
    for name, s in groups.items():
        errors = ", ".join(f"{k}: {v}" for k, v in s["errors_by_status"].items()) or "-"
        row = [html.escape(name), f"{s['ok']} / {s['requests']}", f"{s['request_throughput']:.2f}",
               f"{s['output_token_throughput']:.1f}", f"{s['total_token_throughput']:.1f}"]
        if with_goodput:
            row.append(f"{s['goodput']:.2f} ({100 * s['goodput_fraction']:.0f}%)"
                       if s.get("goodput_fraction") is not None else "-")
        ttft = s["latency_s"]["ttft"]
        row += [_ms(ttft, "p50"), _ms(s["latency_s"]["tpot"], "p50"), _ms(s["latency_s"]["e2e"], "p50"),
                f"{s['cached_tokens']:,}", str(s["http_429"]), str(s["retries"]),
                errors if errors == "-" else f"<span class='bad'>{html.escape(errors)}</span>"]
        rows.append(row)
    return rows


_LATENCY_TITLES = {"ttft": "Time to first token", "tpot": "Time per output token", "itl": "Inter-token latency",
                   "e2e": "End-to-end latency", "qtfb": "Queue to first byte", "queue": "Client-side send lag"}


def _latency_tables(groups: dict[str, dict]) -> str:
    """One small table per latency (mean, p50, p90, p99, max per group), side by side."""
    boxes = []
    for key, title in _LATENCY_TITLES.items():
        rows = [[html.escape(name)] + [_ms(s["latency_s"][key], q) for q in ("mean", "p50", "p90", "p99", "max")]
                for name, s in groups.items()]
        boxes.append(f"<div><b>{title}</b> (ms){_table(['group', 'mean', 'p50', 'p90', 'p99', 'max'], rows)}</div>")
    return "<div class='grid'>" + "".join(boxes) + "</div>"


def run_report_html(body: dict) -> str:
    """The report of one online run, from the JSON report's body (``report.run_body``)."""
    a = body["analysis"]
    sc = body["scenario"]
    records = [RequestRecord.from_dict(d) for d in body["records"]]
    tenants = list(a["tenants"])
    colour = {t: PALETTE[i % len(PALETTE)] for i, t in enumerate(tenants)}
    o = a["overall"]
    slo = a["slo_s"]
    parts = ["<h1>moegate loadgen report</h1>",
             f"<p class='meta'>Target <b>{html.escape(sc['target_url'])}</b> &middot; started {html.escape(body['started_at'])}"
             f" &middot; {body['duration_s']:.1f} s &middot; seed {sc['seed']}"
             + (" &middot; SLO " + ", ".join(f"{k} &le; {v * 1000:g} ms" for k, v in slo.items()) if slo else "")
             + "</p>"]
    for t in sc["tenants"]:
        arr = t["arrival"]
        if t.get("batch"):
            load = f"Batch API job of {t['batch']['num_requests']} requests"
        elif arr["process"] == "concurrency":
            load = f"concurrency {arr['concurrency']}"
        else:
            load = f"{arr['process']} {arr['rate'] or 'max'} req/s" + (
                f" ramp to {arr['ramp_to']} over {arr['ramp_s']} s" if arr.get("ramp_to") else "")
        ds = t["dataset"]
        data = (f"{ds['kind']}: input {ds['input_len']}, output {ds['output_len']}" if ds["kind"] != "sharegpt"
                else f"ShareGPT {html.escape(str(ds['path']))}")
        parts.append(f"<p class='meta'><b style='color:{colour.get(t['name'], '#333')}'>{html.escape(t['name'])}</b>"
                     f" ({html.escape(t['priority'] or 'no class')}, weight {t['weight']:g}): {load}; {data}; "
                     f"{t['options']['api']}, {'stream' if t['options']['stream'] else 'no stream'}</p>")
    jain = a["fairness"]["jain_index"]
    ttft = o["latency_s"]["ttft"]
    cards = [("requests ok / sent", f"{o['ok']} / {o['requests']}"), ("requests/s", f"{o['request_throughput']:.2f}"),
             ("output tokens/s", f"{o['output_token_throughput']:.1f}"),
             ("TTFT p50 / p99 ms", f"{_ms(ttft, 'p50')} / {_ms(ttft, 'p99')}"),
             ("HTTP 429s", str(o["http_429"]))]
    judged = bool(slo or a.get("slo_by_priority_s"))
    if judged and o.get("goodput_fraction") is not None:
        cards.append(("goodput req/s", f"{o['goodput']:.2f} ({100 * o['goodput_fraction']:.0f}%)"))
    if jain is not None and len(tenants) > 1:
        cards.append(("Jain's fairness index", f"{jain:.3f}"))
    parts.append("<div class='cards'>" + "".join(
        f"<div class='card'><div class='v'>{v}</div><div class='k'>{k}</div></div>" for k, v in cards) + "</div>")

    groups = {"all": o}
    if len(a["tenants"]) > 1:  # one tenant's row would repeat "all"
        groups.update({f"tenant {k}": v for k, v in a["tenants"].items()})
    groups.update({f"class {k}": v for k, v in a["priorities"].items()})
    cols = (["group", "ok / sent", "req/s", "output tok/s", "total tok/s"] + (["goodput req/s (attained)"] if judged else [])
            + ["TTFT p50 ms", "TPOT p50 ms", "E2E p50 ms", "cached prompt tokens", "429s", "retries", "errors by status"])
    parts += ["<h2>Summary</h2>", _table(cols, _summary_rows(groups, judged))]
    # The plots come right after the summary: they are what a reader looks at first.
    parts += ["<h2>Latency distributions</h2>", _fig_html(_latency_cdfs(records, tenants, colour), 400)]
    parts += ["<h2>Over time</h2>", _fig_html(_over_time(a["timeseries"], tenants, colour), 600)]

    parts += ["<h2>TTFT against prompt length</h2>", _fig_html(_ttft_vs_prompt(records, tenants, colour), 400)]
    if len(tenants) > 1:
        parts += ["<h2>Fairness over time</h2>", _fig_html(_fairness_over_time(a["timeseries"]), 320),
                  "<p class='note'>Jain's index per time window over the tenants with requests in flight in that "
                  "window (gaps: fewer than two such tenants).</p>"]
    fair = a["fairness"]
    if len(fair["tenants"]) > 1:
        rows = [[html.escape(n), f"{f['weight']:g}", f["served_tokens"], f"{100 * f['share']:.1f}%",
                 f"{100 * f['weight_share']:.1f}%", f"{f['normalized_share']:.2f}"] for n, f in fair["tenants"].items()]
        parts += ["<h2>Fairness</h2>", _table(["tenant", "weight", "served tokens", "share", "weight share",
                                                "share / weight share"], rows),
                  f"<p class='note'>Served tokens: prompt + completion of requests answered 200. Jain's index over "
                  f"share / weight share: {'-' if jain is None else f'{jain:.3f}'} (1 = service follows the weights). "
                  "Shares only mean something while tenants are backlogged: a tenant that asks for less than its "
                  "share gets less, fairly.</p>"]
    retry = [r for r in records if r.retry_after_s]
    if retry or o["http_429"]:
        ra = o["retry_after_s"]
        parts += ["<h2>Quotas</h2>", f"<p class='note'>{o['http_429']} responses were 429; Retry-After seen "
                  f"{ra['count'] if ra else 0} times" + (f" (min {ra['min']:g} s, median {ra['p50']:g} s, max {ra['max']:g} s)"
                                                         if ra else "") + f"; {o['retries']} retries made.</p>"]
    if body.get("analysis", {}).get("batch_jobs"):
        rows = [[html.escape(j["tenant"]), j["num_requests"], html.escape(str(j["status"])),
                 "-" if j["turnaround_s"] is None else f"{j['turnaround_s']:.1f}",
                 "-" if j.get("completed_lines") is None else j["completed_lines"],
                 html.escape(j["error"] or "-")] for j in a["batch_jobs"]]
        parts += ["<h2>Batch jobs</h2>", _table(["tenant", "requests", "status", "turnaround s", "lines ok", "error"], rows)]

    parts += ["<h2>Latency details</h2>", _latency_tables(groups),
              "<p class='note'>TTFT, ITL, TPOT and E2E count from the first send (retries included); queue to first "
              "byte counts from the scheduled arrival; client-side send lag is scheduled arrival to send (near 0 unless "
              "the load generator itself is overloaded). TPOT = (E2E - TTFT) / (output tokens - 1).</p>"]
    return _page("moegate loadgen report", parts)


def _latency_cdfs(records: list[RequestRecord], tenants: list[str], colour: dict) -> go.Figure:
    fig = make_subplots(rows=1, cols=3, subplot_titles=("Time to first token", "Time per output token",
                                                        "End-to-end latency"), horizontal_spacing=0.07)
    for t in tenants:
        ok = [r for r in records if r.tenant == t and r.ok]
        for col, attr in enumerate(("ttft_s", "tpot_s", "e2e_s"), start=1):
            values = [getattr(r, attr) * 1000 for r in ok if getattr(r, attr) is not None]
            if not values:
                continue
            xs, ys = _cdf(values)
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=t, legendgroup=t, showlegend=col == 1,
                                     line=dict(color=colour[t], width=2, shape="hv")), row=1, col=col)
    for col in (1, 2, 3):
        fig.update_xaxes(title_text="ms", row=1, col=col)
    fig.update_yaxes(title_text="fraction of requests", range=[0, 1.02], row=1, col=1)
    return fig


def _rolling(xs: list[float], n: int) -> list[float]:
    out = []
    for i in range(len(xs)):
        window = xs[max(0, i - n + 1): i + 1]
        out.append(sum(window) / len(window))
    return out


def _over_time(ts: dict, tenants: list[str], colour: dict) -> go.Figure:
    # Completions per window are spiky (a window holds a few requests): show a rolling mean over ~5 windows.
    smooth = 5
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=("Output tokens/s per tenant (stacked); completed requests/s (dotted, "
                                        f"mean over {smooth * ts['bin_s']:.1f} s)",
                                        "Requests in flight, and those still waiting for their first token"),
                        specs=[[{"secondary_y": True}], [{}]])
    for t in tenants:
        fig.add_trace(go.Scatter(x=ts["t_s"], y=ts["tenant_output_tok_s"][t], name=f"{t} tok/s", stackgroup="tok",
                                 line=dict(color=colour[t], width=1)), row=1, col=1)
    fig.add_trace(go.Scatter(x=ts["t_s"], y=_rolling(ts["completed_req_s"], smooth), name="completed req/s",
                             line=dict(color="#333", dash="dot", width=2)), row=1, col=1, secondary_y=True)
    if any(ts["failed_req_s"]):
        fig.add_trace(go.Scatter(x=ts["t_s"], y=_rolling(ts["failed_req_s"], smooth), name="failed req/s",
                                 line=dict(color="#b00020", dash="dot", width=2)), row=1, col=1, secondary_y=True)
    fig.add_trace(go.Scatter(x=ts["t_s"], y=ts["in_flight"], name="in flight", line=dict(color="#0072B2", width=2,
                                                                                         shape="hv")), row=2, col=1)
    fig.add_trace(go.Scatter(x=ts["t_s"], y=ts["waiting"], name="waiting for first token",
                             line=dict(color="#D55E00", width=2, shape="hv")), row=2, col=1)
    fig.update_yaxes(title_text="tokens/s", row=1, col=1, rangemode="tozero")
    fig.update_yaxes(title_text="requests/s", row=1, col=1, secondary_y=True, rangemode="tozero", showgrid=False,
                     tickmode="auto", nticks=6)
    fig.update_yaxes(title_text="requests", row=2, col=1, rangemode="tozero")
    fig.update_xaxes(title_text="seconds since start", row=2, col=1)
    return fig


def _ttft_vs_prompt(records: list[RequestRecord], tenants: list[str], colour: dict) -> go.Figure:
    fig = go.Figure()
    for t in tenants:
        ok = [r for r in records if r.tenant == t and r.ok and r.ttft_s is not None]
        fig.add_trace(go.Scatter(x=[r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in ok],
                                 y=[r.ttft_s * 1000 for r in ok], mode="markers", name=t,
                                 marker=dict(color=colour[t], size=6, opacity=0.7)))
    fig.update_xaxes(title_text="prompt tokens (server's usage; the dataset's length where absent)")
    fig.update_yaxes(title_text="TTFT ms", rangemode="tozero")
    return fig


def _fairness_over_time(ts: dict) -> go.Figure:
    fig = go.Figure(go.Scatter(x=ts["t_s"], y=ts["jain"], mode="lines+markers", name="Jain's index",
                               line=dict(color="#009E73", width=2), connectgaps=False))
    fig.update_yaxes(title_text="Jain's index", range=[0, 1.05])
    fig.update_xaxes(title_text="seconds since start")
    return fig


def lines_page(title: str, intro: list[str], table_cols: list[str], table_rows: list[list],
               figures: list[tuple[str, go.Figure, int]]) -> str:
    """A generic page: a paragraph or two, one table, some figures (sweep, compare-batching)."""
    parts = [f"<h1>{html.escape(title)}</h1>"] + [f"<p class='meta'>{line}</p>" for line in intro]
    parts.append(_table(table_cols, [[html.escape(str(x)) for x in row] for row in table_rows]))
    for heading, fig, height in figures:
        parts += [f"<h2>{html.escape(heading)}</h2>", _fig_html(fig, height)]
    return _page(title, parts)

