"""``moegate serve``: the OpenAI-compatible server, its engine built from the engine flags
(``engine.engine_flags``) and its replicas laid out (``gateway.cli.engines``)."""

import argparse
import dataclasses
import logging
import os
import sys

from engine import engine_flags
from engine.distributed.replica_layout import replica_configs
from gateway.cli.disaggregated import build_disaggregated, disaggregation_layout
from gateway.cli import gateway_flags
from gateway.cli.engines import build_engines, build_scalable, engine_authkey
from gateway.routing_policy import POLICIES, RouterConfig


def _serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from engine.kv_tiers.disk_dir import check_free
    from engine.loading.model_check import check_model
    from engine.serving.async_engine import EngineError
    from engine.serving.engine_server import parse_address
    from gateway.app import create_app
    from gateway.drain import CUT_GRACE_S
    from tenants.db import SchemaError
    from tenants.migrate import ensure_schema

    # Bad settings are bad input (ValueError: one line, exit 2), found before anything is written.
    engine_config = engine_flags.engine_config(args)
    remote = [parse_address(a) for a in args.engine]
    disaggregated = disaggregation_layout(args, engine_config, parse_address)  # None: not asked for
    if disaggregated is None and args.local_replicas < 0 or (args.local_replicas == 0 and not remote):
        raise ValueError(f"--data-parallel-size must be >= 1 (0 only with --engine), got {args.local_replicas}")
    authkey = engine_authkey() if remote or (disaggregated and disaggregated.remote) else b""
    if args.engines_share_experts and not (engine_config.enable_expert_parallel and remote and args.local_replicas):
        raise ValueError("--engines-share-experts makes the --engine replicas ranks of the local replicas' expert "
                         "group: it needs --enable-expert-parallel, at least one --engine and a local replica")
    group_remotes = len(remote) if args.engines_share_experts else 0
    most = args.max_local_replicas if args.max_local_replicas is not None else args.local_replicas
    if most < args.local_replicas:
        raise ValueError(f"--max-data-parallel-size must be >= --data-parallel-size ({args.local_replicas}), got {most}")
    if most > args.local_replicas and (remote or disaggregated is not None or args.local_replicas < 1
                                       or engine_config.enable_expert_parallel):
        raise ValueError("--max-data-parallel-size scales local replicas only: not with --engine, disaggregated "
                         "serving or --enable-expert-parallel, and from --data-parallel-size 1 or more")
    local_configs = (sum(disaggregated.local_engines(), []) if disaggregated is not None else
                     replica_configs(engine_config, args.local_replicas, group_remotes))  # checks the combination
    if args.engine_stall_timeout <= 0:
        raise ValueError(f"--engine-stall-timeout must be > 0, got {args.engine_stall_timeout}")
    if not 0 < args.engine_restart_backoff_s <= args.engine_restart_backoff_max_s:
        raise ValueError(f"--engine-restart-backoff must be > 0 and at most --engine-restart-backoff-max, got "
                         f"{args.engine_restart_backoff_s:g} and {args.engine_restart_backoff_max_s:g}")
    config = gateway_flags.gateway_config(args, metrics_token=os.environ.get("MOEGATE_METRICS_TOKEN") or None,
                                          admin_token=os.environ.get("MOEGATE_ADMIN_TOKEN") or None)
    url = config.database_url
    check_model(local_configs[0] if local_configs else engine_config)  # as laid out in the group
    for local in local_configs:
        if local.disk_cache_dir is not None:
            check_free(local.disk_cache_dir)  # another server's engine holds it: one line, exit 2
    try:
        # The policy database must match this code; the embedded SQLite default upgrades itself.
        ensure_schema(url)
    except SchemaError as e:
        print(f"moegate serve: error: {e}", file=sys.stderr)
        return 2
    import asyncio

    from gateway.bootstrap import bootstrap

    key, deployment = asyncio.run(bootstrap(url))
    if key is not None:
        print(f"created tenant 'default' with API key (shown only this once): {key}", flush=True)
    # The engines' disk tiers keep only this database's blocks (engine.kv_tiers.disk_dir).
    engine_config = dataclasses.replace(engine_config, deployment_id=deployment)
    if disaggregated is not None:
        disaggregated = disaggregation_layout(args, engine_config, parse_address)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    scaler = None
    if disaggregated is not None:
        engines = build_disaggregated(disaggregated, authkey, args.engine_stall_timeout, args.fleet_fairness)
    elif most > args.local_replicas:
        engines, scaler = build_scalable(engine_config, args.local_replicas, most, args.router,
                                         args.engine_stall_timeout, args.fleet_fairness)
    else:
        engines = build_engines(engine_config, args.local_replicas, remote, authkey, args.router,
                                args.engine_stall_timeout, group_remotes, args.fleet_fairness)
    app = create_app(config, engines, scaler)
    try:
        # handler_cancellation: a client that disconnects cancels its handler, which aborts its engine request.
        # SIGTERM/SIGINT: stop accepting, let in-flight requests run up to the drain timeout, then cut them
        # (the app's own drain, gateway/drain.py; aiohttp's shutdown_timeout is only a backstop after it),
        # and only then stop the engine and write the last usage (cleanup contexts).
        web.run_app(app, host=config.host, port=config.port, print=lambda msg: logging.info(msg.strip()),
                    handler_cancellation=True, shutdown_timeout=CUT_GRACE_S,
                    keepalive_timeout=config.keepalive_timeout_s)
    except EngineError as e:
        print(f"moegate serve: error: {e}", file=sys.stderr)
        return 1
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="start the OpenAI-compatible server")
    engine_flags.add_engine_flags(p, exclude=engine_flags.REPLICA_FIELDS)
    gateway_flags.add_gateway_flags(p)
    p.add_argument("--data-parallel-size", dest="local_replicas", type=int, default=1, metavar="N",
                   help="engine replicas on this node, each a whole engine with its own KV cache (default 1); "
                        "on a GPU node replica i takes the --tensor-parallel-size GPUs after the previous "
                        "replicas' (size 1: GPU i), on a CPU they share the cores; with --enable-expert-parallel "
                        "the replicas divide the experts among all their ranks; with --distributed-executor-backend "
                        "ray each replica's ranks are a placement group of their own, anywhere on the cluster")
    p.add_argument("--max-data-parallel-size", dest="max_local_replicas", type=int, default=None, metavar="N",
                   help="the most local replicas `moegate admin replicas set` may scale to while serving (default: "
                        "--data-parallel-size, a fixed fleet); needs MOEGATE_ADMIN_TOKEN")
    p.add_argument("--prefill-replicas", type=int, default=0, metavar="P",
                   help="disaggregated serving: P local engines that only prefill prompts and hand their KV to the "
                        "decode engines (with --decode-replicas; docs/disaggregation.md)")
    p.add_argument("--decode-replicas", type=int, default=0, metavar="D",
                   help="disaggregated serving: D local engines that receive prompts' KV and generate")
    p.add_argument("--prefill-max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="the local prefill engines' --max-num-batched-tokens (default: --max-num-batched-tokens): "
                        "they keep no streams waiting, so their steps may be longer than the decode engines'")
    p.add_argument("--prefill-engine", action="append", default=[], metavar="HOST:PORT",
                   help="a remote prefill engine (moegate engine --listen HOST:PORT --role prefill); repeatable")
    p.add_argument("--decode-engine", action="append", default=[], metavar="HOST:PORT",
                   help="a remote decode engine (moegate engine --listen HOST:PORT --role decode); repeatable")
    p.add_argument("--engine", action="append", default=[], metavar="HOST:PORT",
                   help="attach an engine started with `moegate engine --listen HOST:PORT` as one more replica "
                        "(repeatable; needs MOEGATE_ENGINE_KEY); --model still names the tokenizer")
    p.add_argument("--engines-share-experts", action="store_true",
                   help="with --enable-expert-parallel: the --engine replicas join the local replicas' group that "
                        "divides the experts, as ranks L, L+1, ... in the order given (each started with moegate "
                        "engine --data-parallel-size and --data-parallel-rank; needs --distributed-init-method); "
                        "without it they are independent replicas")
    p.add_argument("--engine-stall-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="an engine that sends nothing for this long while requests wait on it is treated as dead "
                        "and replaced (default 60; it must exceed the longest step)")
    p.add_argument("--router", default=RouterConfig().policy, choices=POLICIES,
                   help="how requests are spread over replicas: by prefix-cache affinity traded against load "
                        "(default), or in turn")
    p.add_argument("--fleet-fairness", action="store_true",
                   help="with several engines: tenant weights hold over all of them (requests wait in the gateway "
                        "until an engine has a free slot, and the tenant owed the most service over every engine "
                        "goes next); without it each engine shares only its own capacity by weight")
    p.set_defaults(func=_serve)
