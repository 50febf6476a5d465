"""Engine subcommands for the ``moegate`` console script: ``moegate demo-model DIR [--seed N]``."""

import argparse
import sys


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
