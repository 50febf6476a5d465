"""A follower rank of an engine: its slices of the model, stepping as its replica's rank 0's plans say, until
told to stop.

Run as ``python -m engine.ranks.follower`` (or ``moegate engine-rank``)
with the ``torchrun`` variables set: each engine process starts its node's
followers so, and ranks on other nodes are started so by ``torchrun`` or by
hand. The engine's config comes from world rank 0 once the ranks have met.
"""

import argparse
import dataclasses
import logging
import multiprocessing
import os
import signal
import sys

import torch

from engine.core.config import EngineConfig, KernelChoice
from engine.distributed.groups import CollectiveError, RankGroups, RankInfo
from engine.ranks.rank_flags import add_rank_flags
from engine.distributed.parallel_groups import parallel_groups
from engine.ranks.engine_ranks import EXIT_WITH_PARENT_ENV
from engine.distributed.world import agree_on_world
from engine.processes.parent_watch import exit_with_parent
from engine.worker.rank_messages import Stop, receive_message

logger = logging.getLogger(__name__)


def run_follower(info: RankInfo, device_type: str, timeout_s: float, model_dir: str | None = None) -> None:
    """Join the world, check with every rank that it fits, take this replica's config from its engine process
    (``model_dir``: where this node keeps the same checkpoint, if elsewhere), build this rank's model and runner
    as that process builds its own, then follow its plans; returns when it sends ``Stop``, raises
    CollectiveError when it or a peer fails, ValueError (on every rank) when the world does not fit."""
    from engine.ranks.rank_builder import build_rank
    from engine.worker.model_setup import engine_model_config, resolve_dtype

    device = torch.device("cuda", info.local_rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    logger.info("rank %d of %d: waiting for its group at %s", info.rank, info.world_size, info.init_method)
    groups = RankGroups(info, device, timeout_s)
    try:
        parts = parallel_groups(groups, agree_on_world(groups, None))
        plans = parts.plans
        config: EngineConfig = plans.broadcast_object()  # from this replica's engine process
        if model_dir:
            config = dataclasses.replace(config, model=model_dir)
        if device.type == "cpu" and config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        model_config = engine_model_config(config)  # a random-weight spec and its seed come in the config too
        dtype = resolve_dtype(config.dtype, model_config.torch_dtype, device)
        runner = build_rank(config, model_config, KernelChoice.resolve(config.kernels, device.type), dtype, device,
                            parts.tp, parts.stage).runner  # LoRA: its slices of the factors (engine.lora.lora_shard)
        for name, path in (config.lora_adapter_paths.items() if runner.lora is not None else ()):
            runner.lora.hold(name, path)  # host copies as rank 0 holds them once its adapters are added
        # This replica's engine process's messages (engine.worker.rank_messages), each to its handler, until Stop.
        while not isinstance(message := receive_message(plans), Stop):
            runner.follow(message)
    finally:
        groups.close()


def run(args: argparse.Namespace) -> int:
    """``moegate engine-rank``: exit 2 with one line for missing or bad torchrun variables."""
    # A rank started by hand ends at once on Ctrl-C, by the signal's default action: it holds nothing to save,
    # and a Python handler would only run once torch returned from the rendezvous or collective it waits in
    # (minutes). One its engine process started ignores it: it ends with that process, once the gateway has let
    # its requests finish (a terminal's Ctrl-C reaches every process of the group at once).
    started_by_engine = os.environ.get(EXIT_WITH_PARENT_ENV, "").isdigit()
    signal.signal(signal.SIGINT, signal.SIG_IGN if started_by_engine else signal.SIG_DFL)
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
    except ValueError as e:  # the world does not fit together (every rank says the same)
        print(f"moegate engine-rank: error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-rank %(levelname)s %(message)s")
    if multiprocessing.parent_process() is not None:  # started by its engine process (``EngineRanks``)
        exit_with_parent()
    elif (parent := os.environ.get(EXIT_WITH_PARENT_ENV, "")).isdigit():
        exit_with_parent(int(parent))
    parser = argparse.ArgumentParser(prog="python -m engine.ranks.follower", description=__doc__)
    add_rank_flags(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
