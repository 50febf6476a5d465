"""SLO admission against a real gateway and engine process on the demo model, each step slowed by a known
``STEP_S`` (tests/gateway/slow_step.py), so a queue of prefill takes, and is predicted to take, at least a known
time: a realtime request behind it is refused at once with Retry-After; a class that queues admits it and counts it
missed; the verdicts reach /metrics and the ledger. (That a less urgent class's queue is not ahead of realtime's is
tests/gateway/test_slo_prediction.py's.)"""

import asyncio
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.slo_admission import SLO
from tenants.store import TenantStore
from tests.gateway.in_process import in_process_server
from tests.gateway.slow_step import STEP_S, run_with_slow_steps

BUDGET = 32  # max_num_batched_tokens: a 200-token prompt is 7 steps of at least STEP_S
TTFT_SLO_MS = 300
FLOOD = 6  # prompts of 200 tokens: 38 steps, at least 760 ms of prefill, ahead of anything behind them
PROMPT = [5 + i % 100 for i in range(200)]


def _register(keys: dict):
    def before_start(_demo, url):
        async def main():
            store = TenantStore.open(url)
            try:
                await store.create_class("flooder", 0)  # as urgent as realtime: its prefill is ahead of realtime's
                # Less urgent than the flood, so strictly behind it: the engine shares a class's turns fairly
                # among its tenants, and a request of the flood's class could be served between its prompts.
                await store.create_class("rtq", 1)
                await store.set_class_objectives("realtime", ttft_slo_ms=TTFT_SLO_MS, itl_slo_ms=10_000,
                                                 slo_action="refuse")
                await store.set_class_objectives("rtq", ttft_slo_ms=TTFT_SLO_MS, slo_action="queue")
                for tenant, cls in (("rt", "realtime"), ("q", "rtq"), ("flood", "flooder"), ("bg", "batch")):
                    await store.create_tenant(tenant, cls)
                    keys[tenant] = (await store.create_key(tenant))[1]
            finally:
                await store.close()
        asyncio.run(main())
    return before_start


async def _complete(session, base, key, prompt, max_tokens=2) -> tuple[int, dict, dict, float]:
    start = time.perf_counter()
    async with session.post(f"{base}/completions", headers={"Authorization": f"Bearer {key}"},
                            json={"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                  "ignore_eos": True}) as r:
        body = await r.json()
        return r.status, dict(r.headers), body, time.perf_counter() - start


async def _flood_queued(session, base, key, app, priority: int) -> list[asyncio.Task]:
    """FLOOD long prompts of a class of ``priority`` admitted (counted as queued prefill), answers to come."""
    # Each prompt its own first token: identical prompts would share prefix-cache blocks and finish early.
    tasks = [asyncio.create_task(_complete(session, base, key, [200 + i, *PROMPT[1:]])) for i in range(FLOOD)]
    deadline = time.monotonic() + 5
    while app[SLO].pending.get(priority, 0) < FLOOD * len(PROMPT) // 2:  # most admitted, none near done
        assert time.monotonic() < deadline, "the flood was never admitted"
        await asyncio.sleep(0.002)
    return tasks


def test_slo_admission_refuses_queues_and_counts(tmp_path):
    keys: dict[str, str] = {}
    with in_process_server(tmp_path, dict(device="cpu", dtype="float32", num_kv_blocks=512, block_size=16,
                                          cpu_threads=1, max_num_seqs=16, max_num_batched_tokens=BUDGET,
                                          overlap_scheduling=False),
                           gateway=dict(metrics_token="metrics-secret"),
                           engine_options=dict(process_main=run_with_slow_steps),
                           before_start=_register(keys)) as srv:
        app = srv.server.app
        base = srv.base_url

        async def scenario():
            async with aiohttp.ClientSession() as session:
                # Warm: a step measured, every key's policy cached. Nothing measured yet: admitted.
                for tenant in ("rt", "q", "flood", "bg"):
                    status, _, _, _ = await _complete(session, base, keys[tenant], [5, 6, 7])
                    assert status == 200
                a, b = app[SLO].steps.line()
                assert a + b * 3 >= STEP_S * 1e3  # the injected step time is measured

                # A flood as urgent as realtime: a realtime request is refused at once, with Retry-After.
                tasks = await _flood_queued(session, base, keys["flood"], app, priority=0)
                status, headers, body, elapsed = await _complete(session, base, keys["rt"], [5, 6, 7])
                assert status == 503 and body["error"]["code"] == "slo_unattainable", body
                assert int(headers["Retry-After"]) >= 1
                assert elapsed < 0.05, f"refusal took {elapsed * 1e3:.1f} ms"
                # The class that queues admits its request, which waits behind the flood and misses.
                q = await _complete(session, base, keys["q"], [5, 6, 7])
                assert q[0] == 200
                for t in tasks:
                    assert (await t)[0] == 200
                # The queue drained: realtime admitted again.
                assert (await _complete(session, base, keys["rt"], [5, 6, 7]))[0] == 200

                async with session.get(f"{base.removesuffix('/v1')}/metrics",
                                       headers={"Authorization": "Bearer metrics-secret"}) as r:
                    assert r.status == 200
                    return await r.text()

        text = srv.run(scenario())
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}

    def value(name, tenant, cls, **extra):
        return samples.get((name, tuple(sorted({"tenant": tenant, "priority_class": cls, **extra}.items()))), 0)

    # Whether an admitted request met its objective depends on the machine (a loaded one may miss): the verdicts
    # are checked for consistency; only the refusal, and the queued request's miss (it waited behind at least
    # FLOOD * 200 / BUDGET steps of STEP_S), are certain.
    rt = {o: value("moegate_slo_requests_total", "rt", "realtime", outcome=o) for o in ("met", "missed", "refused")}
    q = {o: value("moegate_slo_requests_total", "q", "rtq", outcome=o) for o in ("met", "missed", "refused")}
    assert rt["refused"] == 1 and rt["met"] + rt["missed"] == 2
    assert q["refused"] == 0 and q["missed"] >= 1 and q["met"] + q["missed"] == 2
    assert value("moegate_slo_attainment", "rt", "realtime") == pytest.approx(rt["met"] / 3)
    assert value("moegate_slo_attainment", "q", "rtq") == pytest.approx(q["met"] / 2)
    assert value("moegate_goodput_tokens_total", "rt", "realtime") == 2 * rt["met"]
    assert value("moegate_goodput_tokens_total", "flood", "flooder") == 2 * (FLOOD + 1)  # no objectives: all good
    assert value("moegate_rejections_total", "rt", "realtime", reason="slo_unattainable") == 1

    async def ledger():
        store = TenantStore.open(srv.database_url)
        try:
            return {row["class"]: row for row in await store.usage_summary(by="class")}
        finally:
            await store.close()

    rows = asyncio.run(ledger())
    assert (rows["realtime"]["slo_requests"], rows["realtime"]["slo_met"]) == (2, rt["met"])  # the refusal never ran
    assert rows["realtime"]["goodput_tokens"] == 2 * rt["met"]
    assert (rows["rtq"]["slo_requests"], rows["rtq"]["slo_met"]) == (2, q["met"])
    assert rows["batch"]["slo_requests"] == 0 and rows["batch"]["goodput_tokens"] == 2
