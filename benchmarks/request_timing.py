"""Where the slowest requests of an open-loop run spend their time: client and server clocks side by side.

The gateway overhead benchmark measures latency at the client, from each request's
scheduled send time. When its p99 moves between runs of the same code, the question is
whether the slow requests were slow inside the server's handler or outside it (the
client falling behind, the kernel, the server's event loop busy with something else
before it parsed the request). This module answers it per request:

* the client sends ``x-bench-seq`` and records, on CLOCK_MONOTONIC (one clock for every
  process on the machine), when the request was due, when its task started and when the
  response was read;
* the server, with ``timing_middleware`` outermost, records when the handler chain saw
  the request and when it returned its response (aiohttp writes a small body right after);
* ``breakdown`` joins them and splits each latency into four parts that add up to it.
"""

import json
import statistics
import time
from dataclasses import dataclass

from aiohttp import web

SEQ_HEADER = "x-bench-seq"
_TIMES = web.AppKey("bench_request_times", list)


def now_ns() -> int:
    """The clock both sides use: CLOCK_MONOTONIC is shared by all processes on one machine."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


@web.middleware
async def timing_middleware(request: web.Request, handler):
    """Outermost middleware: (seq, handler entry, handler exit) of every request that carries a seq."""
    entered = now_ns()
    try:
        return await handler(request)
    finally:
        seq = request.headers.get(SEQ_HEADER)
        if seq is not None:
            request.app[_TIMES].append((int(seq), entered, now_ns()))


def install(app: web.Application, path: str) -> None:
    """Time every request of ``app`` and write the records to ``path`` (JSON) when the app stops."""
    app[_TIMES] = []
    app.middlewares.insert(0, timing_middleware)

    async def dump(app: web.Application) -> None:
        with open(path, "w") as f:
            json.dump(app[_TIMES], f)

    app.on_cleanup.append(dump)


@dataclass
class ClientRecord:
    """One counted request as the client saw it (ns on CLOCK_MONOTONIC)."""

    seq: int
    due: int  # its scheduled (Poisson) send time
    started: int  # when its task began sending
    done: int  # when the response body had been read


PARTS = ("client_lag", "to_handler", "in_handler", "back_to_client")


def breakdown(client: list[ClientRecord], server: list[tuple[int, int, int]], worst_fraction: float = 0.01) -> dict:
    """Split each latency (done - due) into parts that sum to it, for all requests and the slowest ones.

    client_lag: due -> task started (the client's loop behind schedule);
    to_handler: task started -> the server's handler chain entered (client send, kernel,
    the server's loop reaching the request and parsing it);
    in_handler: the handler chain (auth, admission, engine, ledger hand-off, body build);
    back_to_client: handler returned -> the client had read the body (the write, the
    kernel, the client's loop reaching the response).
    Returns median ms of each part over all requests and over the slowest ``worst_fraction``,
    and how many client records had no server record (they are left out).
    """
    by_seq = {seq: (entered, left) for seq, entered, left in server}
    rows = []
    for c in client:
        if c.seq not in by_seq:
            continue
        entered, left = by_seq[c.seq]
        parts = (c.started - c.due, entered - c.started, left - entered, c.done - left)
        rows.append((c.done - c.due, parts))
    if not rows:
        raise ValueError("no client record matched a server record")
    rows.sort(key=lambda r: r[0])
    worst = rows[-max(1, int(len(rows) * worst_fraction)):]

    def medians(selected) -> dict:
        return {name: statistics.median(r[1][i] for r in selected) / 1e6 for i, name in enumerate(PARTS)} | {
            "latency": statistics.median(r[0] for r in selected) / 1e6}

    return {"all": medians(rows), "worst": medians(worst), "n": len(rows), "n_worst": len(worst),
            "unmatched": len(client) - len(rows)}


def format_breakdown(name: str, result: dict) -> str:
    cols = ("latency",) + PARTS
    head = "    " + f"{name} per-request time (median ms)".ljust(40) + " ".join(f"{c:>14s}" for c in cols)
    lines = [head]
    for group, label in (("all", f"all {result['n']}"), ("worst", f"slowest {result['n_worst']}")):
        lines.append("    " + label.rjust(40) + " ".join(f"{result[group][c]:14.3f}" for c in cols))
    return "\n".join(lines)
