"""The flags of one follower rank (``moegate engine-rank``, ``python -m engine.ranks.follower``). No torch
here: ``moegate`` builds its parser with them."""

import argparse


def add_rank_flags(p: argparse.ArgumentParser) -> None:
    """Its device kind, its collectives' timeout and where this node keeps the checkpoint; everything else comes
    from rank 0."""
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="this rank's device kind (it takes cuda:LOCAL_RANK; auto: CUDA when there is one)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds a collective inside a step may take before the rank gives up (default 30); "
                        "give the same as rank 0's --distributed-timeout")
    p.add_argument("--model", default=None,
                   help="this node's path to the checkpoint rank 0 serves, if not the same path as rank 0's")
