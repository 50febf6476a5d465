"""``sweep``: find the saturation rate, then measure a series of rates below it.

Step 0 sends every request at once (the throughput process); the requests/s
it achieves is the saturation rate. Then ``points`` runs follow at
``(i + 1) / (points + 1)`` of it (20%, 40%, 60%, 80% for 4 points) with the
tenant's arrival process (Poisson unless gamma or constant was asked for), the
same dataset and the same request bounds. GuideLLM's sweep works the same way.
"""

import dataclasses

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from loadgen.arrivals import ArrivalConfig
from loadgen.report_html import PALETTE, lines_page
from loadgen.runner import RunResult, run
from loadgen.scenario import Scenario

SWEEP_COLUMNS = ["step", "offered req/s", "achieved req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
                 "TPOT p99 ms", "E2E p50 ms", "E2E p99 ms", "goodput req/s", "failed"]


def sweep_rates(saturation: float, points: int) -> list[float]:
    return [saturation * (i + 1) / (points + 1) for i in range(points)]


def run_sweep(scenario: Scenario, points: int, show_progress: bool = False, on_step=None) -> list[tuple[str, float | None, RunResult]]:
    """(label, offered rate or None for the saturation step, result) for each step. One tenant only."""
    if len(scenario.tenants) != 1 or scenario.tenants[0].batch is not None:
        raise ValueError("sweep drives one tenant (no scenario with several tenants or batch jobs)")
    if points < 1:
        raise ValueError("--sweep-points must be >= 1")
    tenant = scenario.tenants[0]
    if tenant.num_requests is None:
        raise ValueError("sweep needs --num-requests (the saturation step sends them all at once)")
    process = tenant.arrival.process if tenant.arrival.process in ("poisson", "gamma", "constant") else "poisson"
    saturation_tenant = dataclasses.replace(tenant, arrival=ArrivalConfig("throughput"))
    steps = []
    first = run(dataclasses.replace(scenario, tenants=[saturation_tenant], duration_s=None), show_progress)
    steps.append(("saturation", None, first))
    if on_step:
        on_step(steps[-1])
    saturation = first.analysis["overall"]["request_throughput"]
    if saturation <= 0:
        raise ValueError("the saturation step completed no request: nothing to sweep below")
    for rate in sweep_rates(saturation, points):
        arrival = ArrivalConfig(process, rate, tenant.arrival.burstiness)
        result = run(dataclasses.replace(scenario, tenants=[dataclasses.replace(tenant, arrival=arrival)]), show_progress)
        steps.append((f"{100 * rate / saturation:.0f}% of saturation", rate, result))
        if on_step:
            on_step(steps[-1])
    return steps


def _ms(stats: dict | None, key: str) -> str:
    return "-" if not stats else f"{stats[key] * 1000:.1f}"


def sweep_rows(steps) -> list[list]:
    rows = []
    for label, rate, result in steps:
        o = result.analysis["overall"]
        lat = o["latency_s"]
        rows.append([label, "all at once" if rate is None else f"{rate:.2f}", f"{o['request_throughput']:.2f}",
                     f"{o['output_token_throughput']:.1f}", _ms(lat["ttft"], "p50"), _ms(lat["ttft"], "p99"),
                     _ms(lat["tpot"], "p50"), _ms(lat["tpot"], "p99"), _ms(lat["e2e"], "p50"), _ms(lat["e2e"], "p99"),
                     "-" if o["goodput"] is None else f"{o['goodput']:.2f}", o["failed"]])
    return rows


def sweep_html(steps, target: str) -> str:
    below = [(rate, result.analysis["overall"]) for _, rate, result in steps if rate is not None]
    rates = [r for r, _ in below]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("Throughput against offered rate", "Latency against offered rate"))
    fig.add_trace(go.Scatter(x=rates, y=[o["request_throughput"] for _, o in below], name="achieved req/s",
                             mode="lines+markers", line=dict(color=PALETTE[0])), row=1, col=1)
    fig.add_trace(go.Scatter(x=rates, y=rates, name="offered = achieved", mode="lines",
                             line=dict(color="#999", dash="dot")), row=1, col=1)
    for i, (name, key) in enumerate((("TTFT", "ttft"), ("TPOT", "tpot"), ("E2E", "e2e"))):
        for q, dash in (("p50", "solid"), ("p99", "dash")):
            fig.add_trace(go.Scatter(x=rates, y=[(o["latency_s"][key] or {}).get(q, 0) * 1000 for _, o in below],
                                     name=f"{name} {q}", mode="lines+markers",
                                     line=dict(color=PALETTE[i + 1], dash=dash)), row=1, col=2)
    fig.update_xaxes(title_text="offered requests/s")
    fig.update_yaxes(title_text="requests/s", row=1, col=1)
    fig.update_yaxes(title_text="ms", type="log", row=1, col=2)
    saturation = steps[0][2].analysis["overall"]["request_throughput"]
    intro = [f"Target {target}; saturation (all requests at once): {saturation:.2f} req/s; "
             f"then {len(below)} rates below it."]
    return lines_page("moegate loadgen sweep", intro, SWEEP_COLUMNS, sweep_rows(steps), [("Sweep", fig, 460)])
