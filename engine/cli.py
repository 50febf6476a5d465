"""Engine subcommands for the ``moegate`` console script: ``moegate demo-model DIR [--seed N]`` and
``moegate engine-rank`` (a rank of a multi-node engine). The engine's own flags are ``engine.engine_flags``."""

import argparse
import sys

from engine.ranks.rank_flags import add_rank_flags


def _demo_model(args: argparse.Namespace) -> int:
    from engine.loading.demo_model import write_demo_model

    try:
        write_demo_model(args.dir, seed=args.seed)
    except ValueError as e:
        print(f"moegate demo-model: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"moegate demo-model: error: {args.dir}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"wrote a random-weight demo model to {args.dir} (its output is random text)")
    return 0


def _engine_rank(args: argparse.Namespace) -> int:
    import logging

    from engine.ranks.follower import run

    # A rank started by hand says what it waits for (its group, then its engine's plans), as `moegate serve` does.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-rank %(levelname)s %(message)s")
    return run(args)


FEATURES_DESCRIPTION = (
    "Each engine setting that needs or excludes another, and the one line an engine refuses such a combination "
    "with. Settings by their EngineConfig names: each is the flag of the same name with dashes (`moegate engine "
    "--help` lists them). The same list is in docs/configuration.md.")


def register(subparsers) -> None:
    """Add the engine's subcommands to an ``argparse`` subparsers object; each sets ``func(args) -> int``."""
    p = subparsers.add_parser(
        "demo-model",
        help="write a tiny random-weight MoE checkpoint with a real tokenizer (for trying moegate)",
        description="Write a small Qwen3-MoE checkpoint with RANDOM weights (it generates random text) and a "
        "byte-level BPE tokenizer to DIR, to try the engine and gateway without downloading a model.",
    )
    p.add_argument("dir", metavar="DIR", help="directory to write (new, empty, or an earlier demo model)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.set_defaults(func=_demo_model)

    p = subparsers.add_parser("features", help="list which engine settings need or exclude others",
                              description=FEATURES_DESCRIPTION)
    p.add_argument("--markdown", action="store_true", help="print it as the Markdown table of docs/configuration.md")
    p.set_defaults(func=_features)

    p = subparsers.add_parser(
        "engine-rank",
        help="run one rank (1 and up) of an engine split over several nodes",
        description="Join the engine whose rank 0 runs in `moegate serve --tensor-parallel-size N "
        "--distributed-init-method tcp://HOST:PORT --local-ranks M` on another node. Set RANK, WORLD_SIZE, "
        "LOCAL_RANK, MASTER_ADDR and MASTER_PORT as torchrun does; the model and every engine setting come "
        "from rank 0.",
    )
    add_rank_flags(p)
    p.set_defaults(func=_engine_rank)


def _features(args: argparse.Namespace) -> int:
    from engine.core.config_rules import feature_table, feature_text

    print(feature_table() if args.markdown else feature_text(), end="")
    return 0
