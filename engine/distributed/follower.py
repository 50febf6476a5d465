"""A follower rank of an engine: its slices of the model, stepping as its replica's rank 0's plans say, until
told to stop.

Run as ``python -m engine.distributed.follower`` (or ``moegate engine-rank``)
with the ``torchrun`` variables set: each engine process starts its node's
followers so, and ranks on other nodes are started so by ``torchrun`` or by
hand. The engine's config comes from world rank 0 once the ranks have met.
"""

import argparse
import dataclasses
import logging
import sys

import torch

from engine.core.config import EngineConfig, KernelChoice
from engine.distributed.groups import CollectiveError, RankGroups, RankInfo
from engine.distributed.ranks import parallel_groups, take_world_config

logger = logging.getLogger(__name__)


def run_follower(info: RankInfo, device_type: str, timeout_s: float, model_dir: str | None = None) -> None:
    """Join the world, take world rank 0's config (``model_dir``: where this node keeps the same checkpoint, if
    elsewhere), build this rank's model and runner as its replica's rank 0 builds its own, then follow that
    rank's plans; returns when it sends the empty plan (None), raises CollectiveError when it or a peer fails."""
    from engine.llm_engine import resolve_dtype
    from engine.loading.model_config import load_model_config
    from engine.worker.model_setup import build_rank

    device = torch.device("cuda", info.local_rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    groups = RankGroups(info, device, timeout_s)
    try:
        config = take_world_config(groups)
        replica, place = divmod(info.rank, config.tensor_parallel_size)
        if place == 0:
            raise ValueError(f"rank {info.rank} is replica {replica}'s engine process (moegate serve), not a "
                             "follower: start only the other ranks with moegate engine-rank")
        config = dataclasses.replace(config, data_parallel_rank=replica, model=model_dir or config.model)
        if device.type == "cpu" and config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        tp = parallel_groups(groups, config).tp
        model_config = load_model_config(config.model)
        dtype = resolve_dtype(config.dtype, model_config.torch_dtype, device)
        runner = build_rank(config, model_config, KernelChoice.resolve(config.kernels, device.type), dtype, device,
                            tp).runner
        while (plan := tp.broadcast_object()) is not None:  # from this replica's rank 0
            runner.follow(plan)
    finally:
        groups.close()


def run(args: argparse.Namespace) -> int:
    """``moegate engine-rank``: exit 2 with one line for missing or bad torchrun variables."""
    try:
        info = RankInfo.from_env()
        if info.rank == 0:
            raise ValueError("rank 0 is the engine itself (moegate serve); start ranks 1 and up here")
    except ValueError as e:
        print(f"moegate engine-rank: error: {e}", file=sys.stderr)
        return 2
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        run_follower(info, device, args.timeout, args.model)
    except CollectiveError as e:  # rank 0 or a peer went away: the engine restarts its ranks as a whole
        logger.error("%s", e)
        return 1
    except ValueError as e:  # this rank does not fit the world rank 0 describes
        print(f"moegate engine-rank: error: {e}", file=sys.stderr)
        return 2
    return 0


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-rank %(levelname)s %(message)s")
    from engine.cli import add_rank_arguments

    parser = argparse.ArgumentParser(prog="python -m engine.distributed.follower", description=__doc__)
    add_rank_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
