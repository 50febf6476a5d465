"""Through the gateway and the engine process: the disk prefix-cache tier serves a tenant's blocks after a restart
on the same database, and never to a tenant of another database that reuses the tenant's numeric id."""

import asyncio
import random
import time

import aiohttp
import pytest

from engine.loading.demo_model import write_demo_model
from tenants.migrate import upgrade
from tenants.store import TenantStore
from tests.gateway.in_process import in_process_server
from tests.gateway.tenant_keys import new_tenant_key

pytestmark = pytest.mark.timeout(300)
BLOCK = 16


async def _deployment(url: str) -> str:
    store = TenantStore.open(url)
    try:
        return await store.deployment_id()
    finally:
        await store.close()


def test_another_database_on_the_same_disk_cache_gets_no_hit(tmp_path):
    rng = random.Random()
    demo, disk = str(tmp_path / "demo"), tmp_path / "disk"
    write_demo_model(demo, seed=rng.randrange(1000))
    prompt = [rng.randrange(5, 200) for _ in range(4 * BLOCK + 3)]
    settings = dict(block_size=BLOCK, num_kv_blocks=12, max_num_batched_tokens=128, max_model_len=256,
                    host_cache_gb=0.05, disk_cache_dir=str(disk), disk_cache_gb=0.05)

    deployments = {}

    def serve(root):
        """A server on ``root``'s database, its engine given that database's deployment (as moegate serve does)."""
        root.mkdir(exist_ok=True)
        url = f"sqlite:///{root / 'policy.db'}"
        upgrade(url)
        deployments[root.name] = asyncio.run(_deployment(url))
        return in_process_server(root, dict(settings, deployment_id=deployments[root.name]), checkpoint=demo)

    async def cached(srv, key, ids):
        async with aiohttp.ClientSession() as http:
            async with http.post(srv.server.make_url("/v1/completions"), headers={"Authorization": f"Bearer {key}"},
                                 json={"model": "demo", "prompt": ids, "max_tokens": 2, "ignore_eos": True}) as r:
                assert r.status == 200, await r.text()
                return (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"]

    with serve(tmp_path / "a") as srv:
        alice = srv.run(new_tenant_key(srv.database_url, "alice"))  # tenant id 1 of this database
        assert srv.run(cached(srv, alice, prompt)) == 0
        for _ in range(3):  # 5 blocks each through a 12-block pool: the prompt's blocks go to host, then disk
            srv.run(cached(srv, alice, [rng.randrange(5, 200) for _ in range(5 * BLOCK)]))
        deadline = time.monotonic() + 30
        while len(list(disk.glob("*.kvb"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
    written = set(disk.glob("*.kvb"))
    assert len(written) >= 4
    with serve(tmp_path / "a") as srv:  # a restart on the same database: only the disk remembers the prompt
        assert srv.run(cached(srv, alice, prompt)) == 4 * BLOCK
    with serve(tmp_path / "b") as srv:  # another database on the same directory
        mallory = srv.run(new_tenant_key(srv.database_url, "mallory"))  # tenant id 1 again
        assert srv.run(cached(srv, mallory, prompt)) == 0
        # Its engine deleted the other deployment's files at start (mallory's salt alone would miss them too).
        assert (disk / "deployment").read_text() == deployments["b"]
        assert not written & set(disk.glob("*.kvb"))


def test_serve_gives_its_engines_the_database_deployment(tmp_path, monkeypatch, capsys):
    """``moegate serve`` reads the deployment from its database and hands it to the engines it builds."""
    from gateway.cli import main, serve

    url = f"sqlite:///{tmp_path / 'policy.db'}"
    upgrade(url)
    demo = str(tmp_path / "demo")
    write_demo_model(demo, seed=random.randrange(1000))
    seen = []

    def build_engines(config, *args):
        seen.append(config)
        raise ValueError("stopped before any engine starts")

    monkeypatch.setattr(serve, "build_engines", build_engines)
    assert main(["serve", "--model", demo, "--database-url", url, "--host-cache-gb", "0.01",
                 "--disk-cache-dir", str(tmp_path / "disk"), "--disk-cache-gb", "0.01"]) == 2
    assert "stopped before" in capsys.readouterr().err
    assert [c.deployment_id for c in seen] == [asyncio.run(_deployment(url))]


def test_serve_on_a_disk_cache_another_engine_uses_is_one_line_exit_2(tmp_path, capsys):
    from engine.kv_tiers.disk_dir import lock_directory
    from gateway.cli import main

    demo, disk = str(tmp_path / "demo"), tmp_path / "disk"
    write_demo_model(demo, seed=random.randrange(1000))
    disk.mkdir()
    held = lock_directory(str(disk))  # as another server's engine holds it
    try:
        assert main(["serve", "--model", demo, "--database-url", f"sqlite:///{tmp_path / 'policy.db'}",
                     "--host-cache-gb", "0.01", "--disk-cache-dir", str(disk), "--disk-cache-gb", "0.01"]) == 2
    finally:
        held.release()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--disk-cache-dir" in err and "in use by another engine" in err, err
    assert not (tmp_path / "policy.db").exists()  # refused before the database was touched


def report_deployment(config, requests, replies) -> None:
    """A remote engine's process that only says which deployment it was given (as its start-up failure)."""
    from engine.serving.protocol import Fatal, encoder

    replies.send_bytes(encoder.encode(Fatal(f"deployment_id={config.deployment_id}")))


def test_a_remote_engine_is_given_the_gateway_deployment():
    """``moegate engine --listen`` starts each gateway's engine with that gateway's deployment (from its Attach)."""
    import threading

    from engine.core.config import EngineConfig
    from engine.serving.async_engine import EngineError
    from engine.serving.engine_server import serve_engine
    from engine.serving.remote_engine import RemoteEngine

    key, bound, ready = b"k" * 32, [], threading.Event()
    threading.Thread(target=serve_engine, args=(EngineConfig(model="unused", cpu_threads=1), ("127.0.0.1", 0), key,
                                                lambda a: (bound.append(a), ready.set())),
                     kwargs=dict(process_main=report_deployment), daemon=True).start()
    assert ready.wait(10)
    deployment = "%064x" % random.getrandbits(256)
    gateway = RemoteEngine(EngineConfig(model="unused", deployment_id=deployment), bound[0], key)
    with pytest.raises(EngineError, match=f"deployment_id={deployment}"):
        asyncio.run(asyncio.wait_for(gateway.start(), 60))
