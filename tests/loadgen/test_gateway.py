"""loadgen against the real gateway (demo model) on loopback: usage counts, cached tokens, quotas, per-class grouping."""

import asyncio
import time

from aiohttp.test_utils import TestServer

from engine.serving.async_engine import AsyncEngine
from engine.core.config import EngineConfig
from gateway.app import create_app
from gateway.config import GatewayConfig
from loadgen.runner import run_scenario
from loadgen.scenario import scenario_from_dict
from tenants.migrate import upgrade
from tenants.store import TenantStore


async def _tenants(url: str) -> dict[str, str]:
    store = TenantStore.open(url)
    try:
        await store.create_tenant("web")
        await store.create_tenant("vip", priority_class="realtime")
        await store.create_tenant("tight")
        await store.set_quota("tight", requests_per_minute=3)
        return {name: (await store.create_key(name))[1] for name in ("web", "vip", "tight")}
    finally:
        await store.close()


def test_run_against_the_gateway(demo_model_dir, tmp_path):
    url = f"sqlite:///{tmp_path / 'policy.db'}"
    upgrade(url)

    async def go():
        keys = await _tenants(url)
        engine = AsyncEngine(EngineConfig(model=demo_model_dir, num_kv_blocks=256, max_num_batched_tokens=256))
        app = create_app(GatewayConfig(served_model_name="demo", database_url=url), engine)
        async with TestServer(app, host="127.0.0.1") as server:
            scenario = scenario_from_dict({
                "base_url": str(server.make_url("/v1")), "model": "demo", "seed": 1,
                "tenants": [
                    {"name": "web", "api_key": keys["web"], "priority": "standard", "rate": 8, "num_requests": 10,
                     "ignore_eos": True, "dataset": {"input_len": "uniform:8,40", "output_len": "8",
                                                     "tokenizer": demo_model_dir}},
                    {"name": "vip", "api_key": keys["vip"], "priority": "realtime", "concurrency": 1, "num_requests": 4,
                     "api": "chat", "stream": False, "max_tokens": 6,
                     "dataset": {"kind": "shared-prefix", "num_prefixes": 1, "prefix_len": 64, "input_len": "8",
                                 "tokenizer": demo_model_dir}},
                    {"name": "tight", "api_key": keys["tight"], "priority": "standard", "arrival": "constant",
                     "rate": 20, "num_requests": 5, "max_tokens": 2, "dataset": {"input_len": "8"}},
                ]})
            # Quotas count in fixed one-minute windows: start well inside one, so all of `tight`'s five
            # requests (sent within 0.2 s) meet the same counter.
            if time.time() % 60 > 55:
                await asyncio.sleep(60.5 - time.time() % 60)
            return await run_scenario(scenario), scenario

    result, scenario = asyncio.run(go())
    by = {t: [r for r in result.records if r.tenant == t] for t in ("web", "vip", "tight")}
    for r in by["web"]:
        assert r.ok and r.usage_source == "usage" and r.completion_tokens == 8, r
        assert r.prompt_tokens == r.input_len  # the dataset's exact length is what the server counted
        assert r.ttft_s > 0 and r.e2e_s >= r.ttft_s and r.itl_s
    assert all(r.ok and r.completion_tokens <= 6 for r in by["vip"])
    # One shared system prompt, one request at a time: from the second request on, its blocks are cached.
    assert by["vip"][0].cached_tokens == 0 and min(r.cached_tokens for r in by["vip"][1:]) >= 48
    tight = by["tight"]
    assert sum(r.ok for r in tight) == 3 and sorted(r.status for r in tight) == [200, 200, 200, 429, 429]
    limited = [r for r in tight if r.status == 429]
    assert all(r.retry_after_s and r.retry_after_s[0] >= 1 for r in limited)
    assert all(r.ratelimit.get("x-ratelimit-limit-requests") == "3" for r in tight)
    a = result.analysis
    assert a["tenants"]["tight"]["http_429"] == 2 and a["priorities"]["standard"]["requests"] == 15
    assert a["tenants"]["web"]["completion_tokens"] == 80
    assert a["overall"]["cached_tokens"] == sum(r.cached_tokens or 0 for r in result.records if r.ok)
    assert set(a["fairness"]["tenants"]) == {"web", "vip", "tight"}
