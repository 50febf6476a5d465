"""``moegate engine --listen HOST:PORT``: one engine served over TCP to a gateway on another machine."""

import argparse
import logging
import sys

from engine import engine_flags
from gateway.cli.engines import engine_authkey


def register(subparsers) -> None:
    p = subparsers.add_parser("engine", help="serve an engine to a gateway on another machine",
                              description="Serve one engine over TCP to a gateway started with "
                                          "`moegate serve --engine HOST:PORT`; both need MOEGATE_ENGINE_KEY set to "
                                          "the same secret. One gateway at a time. With --enable-expert-parallel "
                                          "and --data-parallel-size, the gateway's local replicas are "
                                          "--data-parallel-rank 0 to L-1, its --engine addresses L, L+1, ... in "
                                          "the order given.")
    p.add_argument("--listen", required=True, metavar="HOST:PORT",
                   help="address to accept the gateway on (port 0: any free port, printed)")
    engine_flags.add_engine_flags(p)
    p.set_defaults(func=_engine)


def _engine(args: argparse.Namespace) -> int:
    from engine.kv_tiers.disk_dir import check_free
    from engine.loading.model_check import check_model
    from engine.serving.engine_server import parse_address, serve_engine

    address = parse_address(args.listen)
    authkey = engine_authkey()
    engine_config = engine_flags.engine_config(args)
    check_model(engine_config)
    if engine_config.disk_cache_dir is not None:
        check_free(engine_config.disk_cache_dir)  # another engine holds it: one line, exit 2
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
