"""``moegate serve``: the OpenAI-compatible server, its engine built from the engine flags
(``engine.engine_flags``) and its replicas laid out (``gateway.cli.engines``)."""

import argparse
import logging
import os
import sys

from engine import engine_flags
from engine.distributed.replica_layout import replica_configs
from gateway.cli.disaggregated import build_disaggregated, disaggregation_layout
from gateway.cli.engines import build_engines, engine_authkey


def _serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from engine.loading.model_check import check_model
    from engine.serving.async_engine import EngineError
    from engine.serving.engine_server import parse_address
    from gateway.app import create_app
    from gateway.drain import CUT_GRACE_S
    from gateway.config import GatewayConfig
    from gateway.cors import parse_origins
    from tenants.db import SchemaError, database_url
    from tenants.migrate import ensure_schema

    url = database_url(args.database_url)
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
    local_configs = ([disaggregated.decode] if disaggregated is not None else
                     replica_configs(engine_config, args.local_replicas, group_remotes))  # checks the combination
    if args.engine_stall_timeout <= 0:
        raise ValueError(f"--engine-stall-timeout must be > 0, got {args.engine_stall_timeout}")
    if not 0 < args.engine_restart_backoff <= args.engine_restart_backoff_max:
        raise ValueError(f"--engine-restart-backoff must be > 0 and at most --engine-restart-backoff-max, got "
                         f"{args.engine_restart_backoff:g} and {args.engine_restart_backoff_max:g}")
    config = GatewayConfig(host=args.host, port=args.port, served_model_name=args.served_model_name, database_url=url,
                           drain_timeout_s=args.drain_timeout, data_dir=args.data_dir,
                           keepalive_timeout_s=args.keepalive_timeout, body_timeout_s=args.body_timeout,
                           max_connections=args.max_connections, metrics_host=args.metrics_host,
                           engine_restart_backoff_s=args.engine_restart_backoff,
                           engine_restart_backoff_max_s=args.engine_restart_backoff_max,
                           metrics_port=args.metrics_port if args.metrics_port >= 0 else None,
                           metrics_token=os.environ.get("MOEGATE_METRICS_TOKEN") or None,
                           admin_token=os.environ.get("MOEGATE_ADMIN_TOKEN") or None,
                           batch_lease_s=args.batch_lease_seconds, batch_max_inflight=args.batch_max_inflight,
                           default_reservation_tokens=args.default_reservation_tokens,
                           responses_retention_s=args.responses_retention_days * 86400,
                           tool_call_parser=_parser_setting(args.tool_call_parser),
                           reasoning_parser=_parser_setting(args.reasoning_parser),
                           allowed_origins=parse_origins(args.allowed_origins))
    check_model(local_configs[0] if local_configs else engine_config)  # as laid out in the group
    try:
        # The policy database must match this code; the embedded SQLite default upgrades itself.
        ensure_schema(url)
    except SchemaError as e:
        print(f"moegate serve: error: {e}", file=sys.stderr)
        return 2
    import asyncio

    from gateway.bootstrap import ensure_default_tenant

    key = asyncio.run(ensure_default_tenant(url))
    if key is not None:
        print(f"created tenant 'default' with API key (shown only this once): {key}", flush=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    if disaggregated is not None:
        engines = build_disaggregated(disaggregated, authkey, args.engine_stall_timeout)
    else:
        engines = build_engines(engine_config, args.local_replicas, remote, authkey, args.router,
                                args.engine_stall_timeout, group_remotes)
    app = create_app(config, engines)
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


def _parser_setting(value: str) -> str | None:
    return None if value == "none" else value


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="start the OpenAI-compatible server")
    engine_flags.add_engine_flags(p, exclude=engine_flags.REPLICA_FIELDS)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may run on after SIGTERM/SIGINT (default 30)")
    p.add_argument("--default-reservation-tokens", type=int, default=512,
                   help="output tokens a request without max_tokens reserves per choice against its tenant's token "
                        "limits; what it really generates is charged when it ends (default 512)")
    p.add_argument("--keepalive-timeout", type=float, default=15.0,
                   help="seconds an idle connection (nothing sent yet, or between requests) stays open (default 15)")
    p.add_argument("--body-timeout", type=float, default=60.0,
                   help="seconds a request body may take to arrive; slower ones get a 408 (default 60)")
    p.add_argument("--max-connections", type=int, default=4096,
                   help="open connections at most; past it new ones are closed at once (default 4096)")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address of the /metrics listener (default 127.0.0.1: the series name tenants)")
    p.add_argument("--metrics-port", type=int, default=9400,
                   help="port of the /metrics listener (default 9400; -1: none). With MOEGATE_METRICS_TOKEN set, "
                        "/metrics is also served on the API port to 'Authorization: Bearer <token>'")
    p.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                   help="browser pages of these origins may call the API (CORS): scheme://host[:port] separated by "
                        "commas, or * for any; preflight requests need no API key (default: none, no CORS headers)")
    p.add_argument("--data-dir", default=".moegate/data", help="Batch API files (default .moegate/data)")
    p.add_argument("--batch-lease-seconds", type=float, default=60.0,
                   help="a crashed gateway's batch lines are taken over after this (default 60)")
    p.add_argument("--batch-max-inflight", type=int, default=None,
                   help="batch lines in the engine at once (default: twice --max-num-seqs)")
    p.add_argument("--database-url", default=None,
                   help="policy database (default: $MOEGATE_DATABASE_URL or sqlite:///./moegate.db)")
    p.add_argument("--data-parallel-size", dest="local_replicas", type=int, default=1, metavar="N",
                   help="engine replicas on this node, each a whole engine with its own KV cache (default 1); "
                        "on a GPU node replica i takes the --tensor-parallel-size GPUs after the previous "
                        "replicas' (size 1: GPU i), on a CPU they share the cores; with --enable-expert-parallel "
                        "the replicas divide the experts among all their ranks")
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
    from gateway.config import GatewayConfig

    defaults = GatewayConfig()
    p.add_argument("--engine-restart-backoff", type=float, default=defaults.engine_restart_backoff_s,
                   metavar="SECONDS",
                   help="an engine replica whose restart failed (a remote engine not reachable yet, say) is tried "
                        "again after this, doubling each time up to --engine-restart-backoff-max "
                        f"(default {defaults.engine_restart_backoff_s:g})")
    p.add_argument("--responses-retention-days", type=float, default=defaults.responses_retention_s / 86400,
                   help="how long a stored Responses API response can be continued (previous_response_id) or read "
                        f"back before it is deleted (default {defaults.responses_retention_s / 86400:g})")
    p.add_argument("--engine-restart-backoff-max", type=float, default=defaults.engine_restart_backoff_max_s,
                   metavar="SECONDS", help="the longest wait between failed restarts of an engine replica "
                                           f"(default {defaults.engine_restart_backoff_max_s:g})")
    from gateway.tool_parsers import REASONING_PARSERS, TOOL_PARSERS

    p.add_argument("--tool-call-parser", default="auto", choices=["auto", "none", *TOOL_PARSERS],
                   help="how tool calls are read from chat output: hermes (Qwen, <tool_call>{...}</tool_call>), "
                        "mistral ([TOOL_CALLS][...]); auto (default): from the checkpoint's chat template; none: off")
    p.add_argument("--reasoning-parser", default="auto", choices=["auto", "none", *REASONING_PARSERS],
                   help="move <think>...</think> into reasoning_content: qwen3; auto (default): when the chat template "
                        "uses <think>; none: off")
    p.add_argument("--router", default="cache-aware", choices=["cache-aware", "round-robin"],
                   help="how requests are spread over replicas: by prefix-cache affinity traded against load "
                        "(default), or in turn")
    p.set_defaults(func=_serve)
