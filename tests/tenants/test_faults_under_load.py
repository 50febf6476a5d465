"""Faults under load against a real gateway: PostgreSQL connections terminated mid-load, and a full
disk under the data directory. Clients get answers in the OpenAI error shape (never a 500 or a hang),
usage is neither lost nor billed twice, and service comes back by itself."""

import asyncio
import os
import subprocess
import time

import aiohttp
import psycopg
import pytest
from aiohttp.test_utils import TestServer

from benchmarks.instant_engine import InstantEngine
from gateway.app import create_app
from gateway.config import GatewayConfig
from tenants.store import TenantStore

from .helpers import tenant_key


@pytest.mark.timeout(180)
def test_postgresql_connections_terminated_mid_load(pg_migrated_url, tmp_path):
    from .conftest import _reset_pg

    _reset_pg(pg_migrated_url)

    async def scenario():
        key = await tenant_key(pg_migrated_url, requests_per_minute=100_000)
        app = create_app(GatewayConfig(database_url=pg_migrated_url, data_dir=str(tmp_path / "data"),
                                       auth_cache_ttl_s=0.0, policy_cache_ttl_s=0.0), InstantEngine())
        statuses: list[int] = []
        async with TestServer(app, host="127.0.0.1") as server:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"},
                                             timeout=aiohttp.ClientTimeout(total=30)) as http:
                stop = time.monotonic() + 8

                async def client():
                    while time.monotonic() < stop:
                        async with http.post(server.make_url("/v1/completions"),
                                             json={"model": "instant", "prompt": "hi", "max_tokens": 4}) as r:
                            body = await r.json()
                            statuses.append(r.status)
                            if r.status != 200:
                                assert r.status == 503 and body["error"]["code"] == "database_unavailable", body

                async def terminator():
                    with psycopg.connect(pg_migrated_url, autocommit=True) as admin:
                        for _ in range(8):
                            await asyncio.sleep(0.8)
                            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                          "WHERE datname = current_database() AND pid <> pg_backend_pid()")

                await asyncio.gather(*(client() for _ in range(8)), terminator())
                # Service is back by itself once the terminations stop.
                async with http.post(server.make_url("/v1/completions"),
                                     json={"model": "instant", "prompt": "hi", "max_tokens": 4}) as r:
                    assert r.status == 200
                    statuses.append(200)
        # The app has stopped: its ledger wrote everything. Billed exactly once per answered request.
        served = statuses.count(200)
        print(f"served {served}, 503s {statuses.count(503)}")
        assert served > 50 and statuses.count(503) + served == len(statuses)
        store = TenantStore.open(pg_migrated_url)
        try:
            (row,) = await store.usage_summary("t", by="tenant")
            assert row["requests"] == served, (row, served, statuses.count(503))
        finally:
            await store.close()

    asyncio.run(scenario())


@pytest.fixture
def tiny_disk(tmp_path):
    """A 512 KiB filesystem (tmpfs), mounted for the test; skipped where mounting is not allowed."""
    path = tmp_path / "tiny"
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.mark.timeout(120)
def test_a_full_disk_under_the_data_directory(tiny_disk, tmp_path):
    from tenants.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'policy.db'}"
    upgrade(url)

    async def scenario():
        key = await tenant_key(url, requests_per_minute=100_000)
        app = create_app(GatewayConfig(database_url=url, data_dir=str(tiny_disk)), InstantEngine())
        async with TestServer(app, host="127.0.0.1") as server, \
                aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http:
            async def upload(size: int):
                form = aiohttp.FormData()
                form.add_field("purpose", "batch")
                form.add_field("file", b"x" * size, filename="in.jsonl")
                async with http.post(server.make_url("/v1/files"), data=form) as r:
                    return r.status, await r.json()

            status, body = await upload(2 * 2**20)  # larger than the disk
            assert status == 503 and body["error"]["code"] == "insufficient_storage", body
            assert os.listdir(tiny_disk / "files") == []  # no partial file left
            async with http.get(server.make_url("/v1/files")) as r:
                assert (await r.json())["data"] == []  # and no row
            status, body = await upload(100 * 2**10)  # a file that fits is stored as usual
            assert status == 200 and body["bytes"] == 100 * 2**10
            async with http.post(server.make_url("/v1/completions"),
                                 json={"model": "instant", "prompt": "hi", "max_tokens": 4}) as r:
                assert r.status == 200  # the rest of the API never noticed

    asyncio.run(scenario())
