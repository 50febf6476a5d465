"""One gateway and engine in this process on a fresh random demo checkpoint: the server the API tests talk to."""

import asyncio
import contextlib
import random
from dataclasses import dataclass
from pathlib import Path

from aiohttp.test_utils import TestServer

from engine.core.config import EngineConfig
from engine.loading.demo_model import write_demo_model
from engine.serving.async_engine import AsyncEngine
from gateway.app import create_app
from gateway.config import GatewayConfig
from tenants.migrate import upgrade


@dataclass
class InProcessServer:
    loop: asyncio.AbstractEventLoop
    server: TestServer
    engine: AsyncEngine
    demo: str  # the checkpoint directory
    database_url: str

    @property
    def base_url(self) -> str:
        return str(self.server.make_url("/v1"))

    def run(self, awaitable):
        return self.loop.run_until_complete(awaitable)


@contextlib.contextmanager
def in_process_server(root: Path, engine: dict, gateway: dict | None = None, engine_options: dict | None = None,
                      checkpoint: str | None = None, before_start=None, engines=None):
    """A served demo model (weights drawn from a random seed) under ``root``, or ``checkpoint``: ``engine`` and
    ``gateway`` are ``EngineConfig`` / ``GatewayConfig`` fields, ``engine_options`` ``AsyncEngine``'s own; stopped
    on exit. ``before_start(checkpoint_dir, database_url)`` runs once the checkpoint and the database exist, before
    the server starts (to register what the server reads at its start). ``engines(config)``: the ``EngineClient``
    the gateway serves from (None: one ``AsyncEngine``)."""
    demo = checkpoint or str(root / "demo")
    if checkpoint is None:
        write_demo_model(demo, seed=random.randrange(1000))
    url = f"sqlite:///{root / 'policy.db'}"
    upgrade(url)
    if before_start is not None:
        before_start(demo, url)
    config = EngineConfig(model=demo, **engine)
    async_engine = engines(config) if engines is not None else AsyncEngine(config, **(engine_options or {}))
    app = create_app(GatewayConfig(served_model_name="demo", database_url=url, data_dir=str(root / "data"),
                                   **(gateway or {})), async_engine)
    loop = asyncio.new_event_loop()
    server = TestServer(app, host="127.0.0.1")
    loop.run_until_complete(server.start_server())
    try:
        yield InProcessServer(loop, server, async_engine, demo, url)
    finally:
        loop.run_until_complete(server.close())
        loop.close()
