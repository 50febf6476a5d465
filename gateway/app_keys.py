"""The application's shared state, by key: the engine, the gateway's config, the usage ledger, the drain flag.

Set by ``gateway/app.py`` when it builds the app; read by the rooms that serve its requests
(``gateway/live_admission.py``) without importing the app.
"""

import asyncio

from aiohttp import web

from engine.serving.client import EngineClient
from gateway.config import GatewayConfig
from gateway.usage_ledger import UsageLedger

ENGINE = web.AppKey("engine", EngineClient)
CONFIG = web.AppKey("config", GatewayConfig)
LEDGER = web.AppKey("ledger", UsageLedger)
DRAINING = web.AppKey("draining", asyncio.Event)  # set on shutdown: in-flight requests finish, new ones get 503
SUPERVISORS = web.AppKey("supervisors", object)  # gateway.engine_supervisor.Supervisors, once the engine started
SCALER = web.AppKey("scaler", object)  # gateway.replica_scaling.ReplicaScaler where runtime scaling is on
