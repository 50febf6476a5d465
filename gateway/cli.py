"""The `moegate` console script. Each package registers its own subcommands."""

import argparse
import logging
import os
import sys

from engine import cli as engine_cli
from engine.core.config import QUANTIZATION_OPTIONS, EngineConfig
from engine.distributed.replica_layout import replica_configs, replica_devices

DEFAULT_DEMO_MODEL_DIR = ".moegate/demo-model"  # the Makefile's DEMO_MODEL, so `make run` and `moegate serve` agree


def _serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from engine.serving.async_engine import EngineError
    from engine.serving.engine_server import parse_address
    from gateway.app import create_app
    from gateway.drain import CUT_GRACE_S
    from gateway.config import GatewayConfig
    from tenants.db import SchemaError, database_url
    from tenants.migrate import ensure_schema

    args.model = args.model or DEFAULT_DEMO_MODEL_DIR  # the embedded default, written on first use
    url = database_url(args.database_url)
    # Bad settings are bad input (ValueError: one line, exit 2), found before anything is written.
    engine_config = serve_engine_config(args)
    remote = [parse_address(a) for a in args.engine]
    if args.data_parallel_size < 0 or (args.data_parallel_size == 0 and not remote):
        raise ValueError(f"--data-parallel-size must be >= 1 (0 only with --engine), got {args.data_parallel_size}")
    authkey = engine_authkey() if remote else b""
    if args.engines_share_experts and not (engine_config.enable_expert_parallel and remote and args.data_parallel_size):
        raise ValueError("--engines-share-experts makes the --engine replicas ranks of the local replicas' expert "
                         "group: it needs --enable-expert-parallel, at least one --engine and a local replica")
    group_remotes = len(remote) if args.engines_share_experts else 0
    local_configs = replica_configs(engine_config, args.data_parallel_size, group_remotes)  # checks the combination
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
                           batch_lease_s=args.batch_lease_seconds, batch_max_inflight=args.batch_max_inflight,
                           default_reservation_tokens=args.default_reservation_tokens,
                           tool_call_parser=_parser_setting(args.tool_call_parser),
                           reasoning_parser=_parser_setting(args.reasoning_parser))
    _check_model(args, local_configs[0] if local_configs else engine_config)  # as laid out in the group
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
    app = create_app(config, build_engines(engine_config, args.data_parallel_size, remote, authkey, args.router,
                                           args.engine_stall_timeout, group_remotes))
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


def _check_model(args: argparse.Namespace, engine_config: EngineConfig) -> None:
    """``--model``: the demo model, if that is the one, is written on first use; a bad checkpoint, or one that
    cannot be split as ``engine_config`` says, is bad input (ValueError: one line, exit 2), found before any
    process starts."""
    from engine.loading.model_config import load_model_config
    from engine.loading.model_loader import checkpoint_files

    if args.model == DEFAULT_DEMO_MODEL_DIR and not os.path.exists(os.path.join(args.model, "config.json")):
        from engine.loading.demo_model import write_demo_model

        print(f"no --model given: writing the random-weight demo model to {args.model} (its output is random text)")
        write_demo_model(args.model)
    if args.random_weights is not None:  # --model then only supplies the tokenizer
        from engine.loading.random_weights import random_model_config
        from engine.text.tokenizer import check_vocabulary, load_tokenizer

        model_config = random_model_config(args.random_weights)
        check_vocabulary(load_tokenizer(args.model), model_config.vocab_size, args.model)
    else:
        model_config = load_model_config(args.model)
        checkpoint_files(args.model)
    if engine_config.tensor_parallel_size > 1 or engine_config.enable_expert_parallel:
        from engine.distributed.split_check import check_split

        check_split(model_config, engine_config)


def engine_authkey() -> bytes:
    """The key a gateway and its remote engines share (``$MOEGATE_ENGINE_KEY``); ValueError if unset."""
    from engine.serving.engine_server import AUTHKEY_ENV

    key = os.environ.get(AUTHKEY_ENV, "")
    if len(key) < 16:
        raise ValueError(f"set {AUTHKEY_ENV} to the same secret (16 characters or more) on the gateway and its engines")
    return key.encode()


def build_engines(engine_config: EngineConfig, local: int, remote: list[tuple[str, int]], authkey: bytes,
                  policy: str, stall_timeout_s: float, group_remotes: int = 0):
    """The gateway's engine: one local engine process, or a router over ``local`` of them and the
    ``remote`` engines (``moegate engine --listen``); each is cut off after ``stall_timeout_s`` of silence
    with requests waiting. ``group_remotes``: how many of the remote engines are ranks of the local replicas'
    expert group (all of them or none)."""
    from engine.serving.async_engine import AsyncEngine
    from engine.serving.remote_engine import RemoteEngine
    from gateway.replica_router import ReplicaRouter
    from gateway.routing_policy import RouterConfig

    if local == 1 and not remote:
        return AsyncEngine(engine_config, stall_timeout_s=stall_timeout_s)
    if local > 1 and engine_config.cpu_threads is None and engine_config.device != "cuda":
        # Replicas on the CPU share its cores: each rank process gets its share, not all of them
        # (oversubscribed threads wait at every parallel region's barrier for a descheduled peer).
        import dataclasses

        processes = local * engine_config.tensor_parallel_size
        engine_config = dataclasses.replace(engine_config, cpu_threads=max(1, (os.cpu_count() or 1) // processes))
    # On GPUs each local replica takes its own devices (on the CPU the variable is ignored); with
    # --enable-expert-parallel the replicas form one group that divides the experts.
    replicas = [AsyncEngine(config, process_env={"CUDA_VISIBLE_DEVICES": replica_devices(config, i)},
                            stall_timeout_s=stall_timeout_s)
                for i, config in enumerate(replica_configs(engine_config, local, group_remotes))]
    group_size = local + group_remotes
    replicas += [RemoteEngine(engine_config, address, authkey, stall_timeout_s,
                              group_place=(local + i, group_size) if group_remotes else None)
                 for i, address in enumerate(remote)]
    names = [str(i) for i in range(local)] + [f"{host}:{port}" for host, port in remote]
    return ReplicaRouter(replicas, names, RouterConfig(policy=policy))


def _engine(args: argparse.Namespace) -> int:
    """``moegate engine --listen HOST:PORT``: serve one engine to a remote gateway."""
    from engine.serving.engine_server import parse_address, serve_engine

    address = parse_address(args.listen)
    authkey = engine_authkey()
    args.model = args.model or DEFAULT_DEMO_MODEL_DIR
    engine_config = serve_engine_config(args)
    _check_model(args, engine_config)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    def listening(bound: tuple[str, int]) -> None:
        print(f"engine listening on {bound[0]}:{bound[1]}", flush=True)

    try:
        serve_engine(engine_config, address, authkey, on_listening=listening)
    except OSError as e:  # the address is taken or not ours
        print(f"moegate engine: error: cannot listen on {args.listen}: {e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


def _add_engine(subparsers) -> None:
    p = subparsers.add_parser("engine", help="serve an engine to a gateway on another machine",
                              description="Serve one engine over TCP to a gateway started with "
                                          "`moegate serve --engine HOST:PORT`; both need MOEGATE_ENGINE_KEY set to "
                                          "the same secret. One gateway at a time.")
    p.add_argument("--listen", required=True, metavar="HOST:PORT",
                   help="address to accept the gateway on (port 0: any free port, printed)")
    add_engine_options(p)
    engine_cli.add_parallel_arguments(p)
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="with --enable-expert-parallel: replicas in the group that divides the experts, on every "
                        "node (the gateway's local replicas and every --engine it attaches); default 1")
    p.add_argument("--data-parallel-rank", type=int, default=0,
                   help="this engine's place in that group: the gateway's local replicas are 0 to L-1, its "
                        "--engine addresses L, L+1, ... in the order given (default 0)")
    p.set_defaults(func=_engine)


def serve_engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's config from ``moegate serve``'s arguments; ValueError for a bad value."""
    engine_config = EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching, kv_cache_memory_gb=args.kv_cache_memory_gb,
        gpu_memory_utilization=args.gpu_memory_utilization,
        background_token_budget=args.background_token_budget, background_window_s=args.background_window_seconds,
        cpu_threads=args.cpu_threads, quantization=args.quantization, overlap_scheduling=args.overlap_scheduling,
        cuda_graph_token_sizes=args.cuda_graph_token_sizes, seed=args.seed, **engine_cli.parallel_fields(args),
        **_replica_rank_fields(args),
        **engine_cli.speculative_fields(args),
    )
    if args.random_weights is not None:
        import dataclasses

        from engine.loading.random_weights import served_name

        engine_config = dataclasses.replace(engine_config, model=served_name(args.random_weights),
                                            random_weights=args.random_weights, tokenizer=args.model)
    return engine_config


def _replica_rank_fields(args: argparse.Namespace) -> dict:
    """``moegate engine``'s place in a group of replicas that divide the experts (``moegate serve`` sets these
    per local replica itself, from its own --data-parallel-size and --engine list)."""
    if not hasattr(args, "data_parallel_rank"):  # moegate serve
        return {}
    return dict(data_parallel_size=args.data_parallel_size, data_parallel_rank=args.data_parallel_rank)


def token_sizes(text: str) -> tuple[int, ...]:
    """``--cuda-graph-token-sizes``: "16,32,64" or "none" (an empty tuple: piecewise graphs off)."""
    if text.strip().lower() == "none":
        return ()
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cuda-graph-token-sizes takes comma-separated token counts or none, "
                                         f"got {text!r}") from None


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The engine's options, shared by ``moegate serve`` and ``moegate engine`` (read by ``serve_engine_config``)."""
    p.add_argument("--model", default=None,
                   help=f"local checkpoint directory (default: the demo model in {DEFAULT_DEMO_MODEL_DIR})")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--quantization", default=None, choices=list(QUANTIZATION_OPTIONS),
                   help="store the routed experts in 8 bits, quantized at load time: fp8 (e4m3, a scale per output "
                        "channel), fp8-block (a scale per 128x128 block) or int8 (weight-only, a scale per output "
                        "channel); default: the model dtype, or an FP8 checkpoint's own scheme")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="KV pool size on the CPU")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--random-weights", metavar="SPEC", default=None,
                   help="serve a RANDOM-weight model of a real shape instead of --model's weights (for speed tests): "
                        "a preset (qwen3-30b-a3b, olmoe-1b-7b, qwen1.5-moe-a2.7b, mixtral-8x7b, gpt-oss-20b, gpt-oss-120b) "
                        "or a config.json path; "
                        "--model then only supplies the tokenizer")
    defaults = EngineConfig(model="-")
    p.add_argument("--seed", type=int, default=defaults.seed,
                   help="seed of --random-weights' weights (every rank and replica of a group must give the same) "
                        f"and of sampling for requests that give none (default {defaults.seed})")
    p.add_argument("--gpu-memory-utilization", type=float, default=defaults.gpu_memory_utilization,
                   help="share of the GPU's memory the engine may use: the KV pool takes what the weights leave of it "
                        f"(default {defaults.gpu_memory_utilization:g})")
    p.add_argument("--background-token-budget", type=int, default=defaults.background_token_budget,
                   help="tokens a step batch work may take while live traffic is present or was within "
                        f"--background-window-seconds (default {defaults.background_token_budget})")
    p.add_argument("--background-window-seconds", type=float, default=defaults.background_window_s,
                   help="how long after live traffic batch work stays capped, and the engine leaves a core to "
                        f"the gateway on the CPU (default {defaults.background_window_s:g})")
    p.add_argument("--overlap-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and prepare the next step while the device runs this one, stop checks one step "
                        "behind (default: on with CUDA, off on the CPU, where it measured no gain)")
    p.add_argument("--cuda-graph-token-sizes", type=token_sizes, default=None, metavar="N,N,...|none",
                   help="token counts prefill and mixed steps are padded to and replayed as piecewise CUDA graphs "
                        "(attention eager between them); none: off (default 16,32,...,512 up to "
                        "--max-num-batched-tokens; CUDA with the Triton MoE kernels only)")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="torch threads of the engine on the CPU, whatever it serves (default: one core fewer "
                        "than the machine while live traffic is recent, every core otherwise)")
    engine_cli.add_speculative_arguments(p)


def _add_serve(subparsers) -> None:
    p = subparsers.add_parser("serve", help="start the OpenAI-compatible server")
    add_engine_options(p)
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
    p.add_argument("--data-dir", default=".moegate/data", help="Batch API files (default .moegate/data)")
    p.add_argument("--batch-lease-seconds", type=float, default=60.0,
                   help="a crashed gateway's batch lines are taken over after this (default 60)")
    p.add_argument("--batch-max-inflight", type=int, default=None,
                   help="batch lines in the engine at once (default: twice --max-num-seqs)")
    p.add_argument("--database-url", default=None,
                   help="policy database (default: $MOEGATE_DATABASE_URL or sqlite:///./moegate.db)")
    engine_cli.add_parallel_arguments(p)
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas on this node, each a whole engine with its own KV cache (default 1); "
                        "on a GPU node replica i takes the --tensor-parallel-size GPUs after the previous "
                        "replicas' (size 1: GPU i), on a CPU they share the cores; with --enable-expert-parallel "
                        "the replicas divide the experts among all their ranks")
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


class OneLineParser(argparse.ArgumentParser):
    """Bad usage is one line on stderr and exit 2 (argparse would print the whole usage block too).

    Subcommand parsers inherit the class, so every package's subcommands behave the same.
    """

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser_setting(value: str) -> str | None:
    return None if value == "none" else value


def build_parser() -> argparse.ArgumentParser:
    from loadgen import cli as loadgen_cli
    from tenants import cli as tenants_cli

    parser = OneLineParser(prog="moegate", description="Multi-tenant serving for MoE language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_engine(sub)
    from gateway.batch import offline as run_batch

    run_batch.register(sub)
    engine_cli.register(sub)
    loadgen_cli.register(sub)
    tenants_cli.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # argparse exits 2 with one line on bad usage
    try:
        return args.func(args)
    except ValueError as e:
        print(f"moegate {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
