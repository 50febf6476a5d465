"""Runs a scenario: every tenant's load at once on one aiohttp session, then the analysis.

Open-loop tenants (poisson, gamma, constant, throughput) send on their
timetable whatever the server does, so queueing shows up as latency; a
closed-loop tenant (concurrency N) keeps N requests in flight. Sending stops
at each tenant's request count or at the scenario's duration; requests still
in flight are awaited (each is bounded by its timeout), so a run always ends.
"""

import asyncio
import datetime
import itertools
import time
from dataclasses import dataclass, field

import aiohttp

from loadgen.arrivals import arrival_times
from loadgen.batch_jobs import run_batch_job
from loadgen.client import send_request
from loadgen.datasets import iter_requests
from loadgen.metrics import analyze
from loadgen.progress import Counters, LiveProgress
from loadgen.records import RequestRecord
from loadgen.scenario import Scenario, TenantSpec


@dataclass(slots=True)
class RunResult:
    """A finished run: every request's record, batch jobs, and the analysis of both."""

    scenario: Scenario
    records: list[RequestRecord]
    duration_s: float
    started_at: str
    batch_jobs: list[dict] = field(default_factory=list)
    analysis: dict = field(default_factory=dict)


def _seed(base: int, tenant_index: int, stream: int) -> int:
    # Separate, stable streams per tenant: adding a tenant does not change the others' prompts or timetables.
    return base * 1_000_003 + tenant_index * 17 + stream


class _Run:
    def __init__(self, scenario: Scenario, session: aiohttp.ClientSession, counters: Counters) -> None:
        self.scenario = scenario
        self.session = session
        self.counters = counters
        self.records: list[RequestRecord] = []
        self.batch_jobs: list[dict] = []
        self._index = itertools.count()
        self._start = time.monotonic()
        self._tasks: set[asyncio.Task] = set()

    def clock(self) -> float:
        return time.monotonic() - self._start

    async def _one(self, tenant: TenantSpec, spec, scheduled_s: float) -> None:
        record = RequestRecord(next(self._index), tenant.name, tenant.priority, scheduled_s=scheduled_s)
        self.records.append(record)
        self.counters.sent += 1
        await send_request(self.session, self.scenario.target(tenant), spec, tenant.options, record, self.clock)
        self.counters.finished(record.ok)

    async def open_loop(self, tenant: TenantSpec, i: int) -> None:
        specs = iter_requests(tenant.dataset, _seed(self.scenario.seed, i, 1))
        times = arrival_times(tenant.arrival, _seed(self.scenario.seed, i, 2), tenant.num_requests, self.scenario.duration_s)
        for offset in times:
            delay = offset - self.clock()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(self._one(tenant, next(specs), offset))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def closed_loop(self, tenant: TenantSpec, i: int) -> None:
        specs = iter_requests(tenant.dataset, _seed(self.scenario.seed, i, 1))
        budget = itertools.count() if tenant.num_requests is None else iter(range(tenant.num_requests))
        duration = self.scenario.duration_s

        async def worker() -> None:
            for _ in budget:  # shared by the workers: together they send num_requests
                now = self.clock()
                if duration is not None and now >= duration:
                    return
                await self._one(tenant, next(specs), now)

        await asyncio.gather(*(worker() for _ in range(tenant.arrival.concurrency)))

    async def batch(self, tenant: TenantSpec, i: int) -> None:
        specs = iter_requests(tenant.dataset, _seed(self.scenario.seed, i, 1))
        b = tenant.batch
        job = await run_batch_job(self.session, self.scenario.target(tenant), tenant.name,
                                  [next(specs) for _ in range(b.num_requests)], tenant.options, b.completion_window,
                                  b.poll_interval_s, b.timeout_s, self.clock)
        job["priority"] = tenant.priority
        self.batch_jobs.append(job)

    async def warm_up(self) -> None:
        """A few requests per tenant, one at a time, unrecorded: first requests pay for cold caches and lazy init."""
        async def one_tenant(tenant: TenantSpec, i: int) -> None:
            specs = iter_requests(tenant.dataset, _seed(self.scenario.seed, i, 3))
            for _ in range(self.scenario.warmup):
                record = RequestRecord(-1, tenant.name)
                await send_request(self.session, self.scenario.target(tenant), next(specs), tenant.options, record,
                                   self.clock)

        await asyncio.gather(*(one_tenant(t, i) for i, t in enumerate(self.scenario.tenants) if t.batch is None))
        self._start = time.monotonic()  # the measured run starts now

    async def run(self) -> None:
        loops = []
        for i, tenant in enumerate(self.scenario.tenants):
            if tenant.batch is not None:
                loops.append(self.batch(tenant, i))
            elif tenant.arrival.scheduled:
                loops.append(self.open_loop(tenant, i))
            else:
                loops.append(self.closed_loop(tenant, i))
        await asyncio.gather(*loops)
        while self._tasks:  # requests sent before the end are still running
            await asyncio.gather(*list(self._tasks))


async def _refresh(live: LiveProgress) -> None:
    while True:
        live.refresh()
        await asyncio.sleep(0.25)


async def run_scenario(scenario: Scenario, show_progress: bool = False) -> RunResult:
    """Run ``scenario`` to its end and analyse it."""
    counters = Counters()
    totals = [t.num_requests for t in scenario.tenants if t.batch is None]
    total = sum(totals) if scenario.duration_s is None and None not in totals else None
    started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    # No connection cap: an open-loop load generator must not queue requests on its own side.
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        run = _Run(scenario, session, counters)
        if scenario.warmup:
            await run.warm_up()
        with LiveProgress(counters, total, scenario.duration_s, show_progress) as live:
            refresher = asyncio.create_task(_refresh(live))
            try:
                await run.run()
            finally:
                refresher.cancel()
        duration = run.clock()
    run.records.sort(key=lambda r: r.index)
    weights = {t.name: t.weight for t in scenario.tenants if t.batch is None}
    result = RunResult(scenario, run.records, duration, started_at, run.batch_jobs)
    result.analysis = analyze(run.records, weights, duration, scenario.slo, scenario.slo_by_priority)
    result.analysis["batch_jobs"] = run.batch_jobs
    return result


def run(scenario: Scenario, show_progress: bool = False) -> RunResult:
    return asyncio.run(run_scenario(scenario, show_progress))
