"""Through the gateway and the engine process: cached tokens from the host tier are reported in usage and in
/metrics per tier and tenant, the tenant's cache share rides along, and another tenant gets none."""

import asyncio
import random
import re

import aiohttp
import pytest

from tests.gateway.in_process import in_process_server
from tests.gateway.tenant_keys import new_tenant_key

pytestmark = pytest.mark.timeout(300)
BLOCK = 16


def test_usage_and_metrics_count_host_tier_hits(tmp_path):
    rng = random.Random()
    with in_process_server(tmp_path, dict(block_size=BLOCK, num_kv_blocks=12, max_num_batched_tokens=128,
                                          max_model_len=256, host_cache_gb=0.05),
                           gateway=dict(metrics_token="m")) as srv:
        acme = srv.run(new_tenant_key(srv.database_url, "acme", cache_share=0.5))
        other = srv.run(new_tenant_key(srv.database_url, "other"))
        prompt = [rng.randrange(5, 200) for _ in range(4 * BLOCK + 3)]

        async def complete(http, key, ids):
            async with http.post(srv.server.make_url("/v1/completions"), headers={"Authorization": f"Bearer {key}"},
                                 json={"model": "demo", "prompt": ids, "max_tokens": 2, "ignore_eos": True}) as r:
                assert r.status == 200, await r.text()
                return (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"]

        async def scenario():
            async with aiohttp.ClientSession() as http:
                first = await complete(http, acme, prompt)
                for _ in range(3):  # 5 blocks each through a 12-block pool: the prompt's blocks go to host
                    await complete(http, acme, [rng.randrange(5, 200) for _ in range(5 * BLOCK)])
                again = await complete(http, acme, prompt)
                stranger = await complete(http, other, prompt)
                async with http.get(srv.server.make_url("/metrics"), headers={"Authorization": "Bearer m"}) as r:
                    return first, again, stranger, await r.text()

        first, again, stranger, metrics = srv.run(scenario())
        assert (first, again, stranger) == (0, 4 * BLOCK, 0)
        hits = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^moegate_prefix_tier_hits_total\{replica="\w+",tenant="(\d+)",tier="host"\} (\S+)$', metrics, re.M)}
        assert hits == {"1": 4.0, "2": 0.0}, hits  # acme (tenant 1): its 4 blocks; the other tenant looked, found none
