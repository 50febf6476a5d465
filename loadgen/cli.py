"""`moegate loadgen ...` subcommands."""

from loadgen import offline


def register(subparsers) -> None:
    p = subparsers.add_parser("loadgen", help="load generation and benchmarks")
    sub = p.add_subparsers(dest="loadgen_command", required=True)
    offline.register(sub)
