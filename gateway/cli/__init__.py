"""The ``moegate`` console script: its parser and entry point. Each package registers its own subcommands;
the gateway's are ``serve`` (``gateway.cli.serve``), ``engine`` (``gateway.cli.remote_engine``) and
``run-batch`` (``gateway.batch.offline``)."""

import argparse
import sys


class OneLineParser(argparse.ArgumentParser):
    """Bad usage is one line on stderr and exit 2 (argparse would print the whole usage block too).

    Subcommand parsers inherit the class, so every package's subcommands behave the same.
    """

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    from engine import cli as engine_cli
    from gateway.batch import offline as run_batch
    from gateway.cli import remote_engine, serve
    from loadgen import cli as loadgen_cli
    from tenants import cli as tenants_cli

    parser = OneLineParser(prog="moegate", description="Multi-tenant serving for MoE language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve.register(sub)
    remote_engine.register(sub)
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
