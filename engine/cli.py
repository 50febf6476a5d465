"""Engine subcommands for the ``moegate`` console script: ``moegate demo-model DIR [--seed N]``,
``moegate engine-rank`` (a rank of a multi-node engine), and the parallelism options ``moegate serve`` takes."""

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


def add_parallel_arguments(p: argparse.ArgumentParser) -> None:
    """The options that split one engine over several processes (one device each)."""
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks the model is split over (attention heads, MLPs, experts, vocabulary); default 1")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="divide the routed experts whole among the ranks instead of splitting each one")
    p.add_argument("--expert-dispatch", default="all_to_all", choices=["all_to_all", "all_gather"],
                   help="how tokens reach their experts' ranks (default all_to_all: each token slot travels once)")
    p.add_argument("--distributed-init-method", default=None, metavar="tcp://HOST:PORT",
                   help="where the ranks meet (default: a free port on this node, every rank here); independent "
                        "replicas split over ranks meet at PORT + their index")
    p.add_argument("--local-ranks", type=int, default=None,
                   help="ranks this node starts of each engine's --tensor-parallel-size (default all); the others "
                        "run `moegate engine-rank` elsewhere")
    p.add_argument("--distributed-timeout", type=float, default=30.0,
                   help="seconds a collective may take before the engine fails and restarts (default 30)")


def parallel_fields(args: argparse.Namespace) -> dict:
    """``EngineConfig`` fields from ``add_parallel_arguments``' options."""
    return dict(tensor_parallel_size=args.tensor_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
                expert_dispatch=args.expert_dispatch, distributed_init_method=args.distributed_init_method,
                local_ranks=args.local_ranks, distributed_timeout_s=args.distributed_timeout)


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    """Speculative decoding's options (``EngineConfig.speculative*``)."""
    from engine.core.config import EngineConfig

    d = EngineConfig(model="-")
    p.add_argument("--speculative", default=None, choices=["ngram", "draft"],
                   help="speculative decoding: 'ngram' proposes the tokens that followed the latest earlier "
                        "occurrence of a request's last tokens, 'draft' the greedy tokens of a small draft model "
                        "(--speculative-model); verified in the same step (default: off)")
    p.add_argument("--speculative-model", default=None, metavar="PATH",
                   help="the draft model's checkpoint directory for --speculative draft (same vocabulary as "
                        "the served model)")
    p.add_argument("--num-speculative-tokens", type=int, default=d.num_speculative_tokens,
                   help=f"draft tokens a request proposes per step (default {d.num_speculative_tokens})")
    p.add_argument("--speculative-max-batch", type=int, default=d.speculative_max_batch,
                   help="no request speculates while more than this many run "
                        f"(default {d.speculative_max_batch})")
    p.add_argument("--speculative-min-acceptance", type=float, default=d.speculative_min_acceptance,
                   help="a request whose recent acceptance rate is below this stops proposing, trying again "
                        f"every few steps (default {d.speculative_min_acceptance:g})")


def speculative_fields(args: argparse.Namespace) -> dict:
    """``EngineConfig`` fields from ``add_speculative_arguments``' options."""
    return dict(speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
                speculative_max_batch=args.speculative_max_batch,
                speculative_min_acceptance=args.speculative_min_acceptance,
                speculative_model=args.speculative_model)


def add_rank_arguments(p: argparse.ArgumentParser) -> None:
    """The options of one follower rank (``moegate engine-rank``, ``python -m engine.distributed.follower``)."""
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="this rank's device kind (it takes cuda:LOCAL_RANK; auto: CUDA when there is one)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds a collective inside a step may take before the rank gives up (default 30); "
                        "give the same as rank 0's --distributed-timeout")
    p.add_argument("--model", default=None,
                   help="this node's path to the checkpoint rank 0 serves, if not the same path as rank 0's")


def _engine_rank(args: argparse.Namespace) -> int:
    from engine.distributed.follower import run

    return run(args)


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

    p = subparsers.add_parser(
        "engine-rank",
        help="run one rank (1 and up) of an engine split over several nodes",
        description="Join the engine whose rank 0 runs in `moegate serve --tensor-parallel-size N "
        "--distributed-init-method tcp://HOST:PORT --local-ranks M` on another node. Set RANK, WORLD_SIZE, "
        "LOCAL_RANK, MASTER_ADDR and MASTER_PORT as torchrun does; the model and every engine setting come "
        "from rank 0.",
    )
    add_rank_arguments(p)
    p.set_defaults(func=_engine_rank)
