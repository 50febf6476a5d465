"""The gateway keeps its startup heap away from the cyclic collector while it serves (gateway/heap.py)."""

import asyncio
import gc

import aiohttp
from aiohttp.test_utils import TestServer

from benchmarks.instant_engine import InstantEngine
from gateway.app import create_app
from gateway.config import GatewayConfig
from tenants.migrate import upgrade


def test_startup_heap_is_frozen_while_serving_and_handed_back_at_cleanup(tmp_path):
    url = f"sqlite:///{tmp_path / 'heap.db'}"
    upgrade(url)

    async def body():
        gc.collect()
        before = len(gc.get_objects())  # tracked objects that exist before the app starts
        app = create_app(GatewayConfig(database_url=url, data_dir=str(tmp_path / "data")), InstantEngine())
        async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as http:
            frozen = gc.get_freeze_count()
            async with http.get(server.make_url("/health")) as r:
                assert r.status == 200
        return before, frozen

    before, frozen = asyncio.run(body())
    assert frozen >= before, f"{frozen} objects frozen, {before} tracked before startup"
    assert gc.get_freeze_count() == 0  # the cleanup handed them back
