"""``moegate serve --prefill-replicas P --decode-replicas D``: the prefill and decode engines of disaggregated
serving, local processes and remote engines (``--prefill-engine`` / ``--decode-engine HOST:PORT``), and the
router over them (``gateway.disaggregation``)."""

import argparse
import dataclasses
import os
from dataclasses import dataclass

from engine.core.config import EngineConfig


@dataclass(frozen=True, slots=True)
class DisaggregatedLayout:
    prefill: EngineConfig  # each local prefill engine's settings
    decode: EngineConfig
    local_prefill: int
    local_decode: int
    remote_prefill: list[tuple[str, int]]
    remote_decode: list[tuple[str, int]]

    @property
    def remote(self) -> bool:
        return bool(self.remote_prefill or self.remote_decode)

    def local_engines(self) -> tuple[list[EngineConfig], list[EngineConfig]]:
        """Each local prefill and each local decode engine's settings. An engine holds its disk tier's directory
        alone (engine.kv_tiers.disk_dir), so each keeps it in ``disk_cache_dir``/prefill-<i> or decode-<i>."""
        return ([_own_disk_cache(self.prefill, f"prefill-{i}") for i in range(self.local_prefill)],
                [_own_disk_cache(self.decode, f"decode-{i}") for i in range(self.local_decode)])


def _own_disk_cache(config: EngineConfig, name: str) -> EngineConfig:
    if config.disk_cache_dir is None:
        return config
    return dataclasses.replace(config, disk_cache_dir=os.path.join(config.disk_cache_dir, name))


def disaggregation_layout(args: argparse.Namespace, config: EngineConfig, parse_address) -> DisaggregatedLayout | None:
    """The layout the flags ask for, None without disaggregation flags; ValueError (one line) for a bad one."""
    remote_p = [parse_address(a) for a in args.prefill_engine]
    remote_d = [parse_address(a) for a in args.decode_engine]
    if not (args.prefill_replicas or args.decode_replicas or remote_p or remote_d):
        return None
    if args.prefill_replicas < 0 or args.decode_replicas < 0:
        raise ValueError("--prefill-replicas and --decode-replicas must be >= 0")
    if args.prefill_replicas + len(remote_p) < 1 or args.decode_replicas + len(remote_d) < 1:
        raise ValueError("disaggregated serving needs at least one prefill engine (--prefill-replicas or "
                         "--prefill-engine) and one decode engine (--decode-replicas or --decode-engine)")
    if args.engine or args.local_replicas != 1:
        raise ValueError("--prefill-replicas/--decode-replicas replace --data-parallel-size and --engine: give "
                         "remote engines with --prefill-engine and --decode-engine")
    if config.role != "both":
        raise ValueError("--role is for `moegate engine --listen`; `moegate serve` gives its engines their roles")
    if config.tensor_parallel_size > 1 or config.data_parallel_size > 1:
        raise ValueError("prefill and decode engines run one process each: --tensor-parallel-size and "
                         "--data-parallel-size must be 1 with --prefill-replicas/--decode-replicas")
    local = args.prefill_replicas + args.decode_replicas
    on_this_node = config.distributed_executor_backend == "mp"  # Ray gives each engine a bundle of its own
    if local > 1 and config.cpu_threads is None and config.device != "cuda" and on_this_node:
        # Engines on the CPU share its cores, as replicas do (gateway.cli.engines).
        config = dataclasses.replace(config, cpu_threads=max(1, (os.cpu_count() or 1) // local))
    prefill = dataclasses.replace(config, role="prefill")
    if args.prefill_max_num_batched_tokens is not None:
        if args.prefill_max_num_batched_tokens < 1:
            raise ValueError("--prefill-max-num-batched-tokens must be >= 1, "
                             f"got {args.prefill_max_num_batched_tokens}")
        prefill = dataclasses.replace(prefill, max_num_batched_tokens=args.prefill_max_num_batched_tokens)
    return DisaggregatedLayout(prefill, dataclasses.replace(config, role="decode"), args.prefill_replicas,
                               args.decode_replicas, remote_p, remote_d)


def build_disaggregated(layout: DisaggregatedLayout, authkey: bytes, stall_timeout_s: float,
                        fleet_fairness: bool = False):
    """The router over the layout's engines; local engine i of either kind takes GPU i of its kind's share, or
    with ``--distributed-executor-backend ray`` is a placement group of its own wherever the cluster has room.
    ``fleet_fairness``: tenant weights held over all of them (``gateway.fleet_fairness``)."""
    from engine.serving.remote_engine import RemoteEngine
    from gateway.cli.engines import local_engine
    from gateway.disaggregation import DisaggregatedEngines

    def local(configs: list[EngineConfig], first_gpu: int) -> list:
        return [local_engine(config, {"CUDA_VISIBLE_DEVICES": str(first_gpu + i)}, stall_timeout_s)
                for i, config in enumerate(configs)]

    def remote(config: EngineConfig, addresses) -> list:
        return [RemoteEngine(config, address, authkey, stall_timeout_s) for address in addresses]

    local_prefill, local_decode = layout.local_engines()
    prefill = local(local_prefill, 0) + remote(layout.prefill, layout.remote_prefill)
    decode = local(local_decode, layout.local_prefill) + remote(layout.decode, layout.remote_decode)
    return DisaggregatedEngines(prefill, decode, fleet_fairness)
