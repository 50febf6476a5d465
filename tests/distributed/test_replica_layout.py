"""A node's replicas: which GPUs each takes, and the configs of replicas that share their experts."""

import os
import random

import pytest

from engine.core.config import EngineConfig
from engine.distributed.replica_layout import replica_configs, replica_devices, replica_world_ranks


def test_each_replica_takes_its_own_gpus_after_the_previous_ones():
    tp, replicas = random.randint(1, 4), random.randint(1, 4)
    config = EngineConfig(model="m", tensor_parallel_size=tp)
    devices = [replica_devices(config, i).split(",") for i in range(replicas)]
    flat = [int(d) for ds in devices for d in ds]
    assert all(len(ds) == tp for ds in devices) and flat == list(range(tp * replicas))


def test_replicas_that_share_experts_are_ranks_of_one_group():
    plain = EngineConfig(model="m")
    assert replica_configs(plain, 3) == [plain] * 3
    shared = EngineConfig(model="m", enable_expert_parallel=True)
    configs = replica_configs(shared, 3)
    assert [c.data_parallel_rank for c in configs] == [0, 1, 2] and {c.data_parallel_size for c in configs} == {3}
    assert len({c.distributed_init_method for c in configs}) == 1 and configs[0].distributed_init_method.startswith("tcp://")
    split = replica_configs(EngineConfig(model="m", enable_expert_parallel=True, tensor_parallel_size=2), 2)
    assert [(c.data_parallel_rank, c.tensor_parallel_size) for c in split] == [(0, 2), (1, 2)]
    # Two local replicas and three engines on other nodes: the local ones are ranks 0 and 1 of 5.
    with pytest.raises(ValueError, match="distributed-init-method"):
        replica_configs(shared, 2, remote=3)
    meet = EngineConfig(model="m", enable_expert_parallel=True, distributed_init_method="tcp://10.0.0.1:29500")
    with_remote = replica_configs(meet, 2, remote=3)
    assert [(c.data_parallel_rank, c.data_parallel_size) for c in with_remote] == [(0, 5), (1, 5)]
    assert {c.distributed_init_method for c in with_remote} == {"tcp://10.0.0.1:29500"}
    assert replica_configs(meet, 1, remote=1)[0].data_parallel_size == 2


def test_independent_replicas_split_over_ranks_each_meet_at_their_own_port():
    """Two replicas' rank 0s cannot both host the rendezvous at one address."""
    port, replicas = random.randint(20000, 30000), random.randint(2, 4)
    split = EngineConfig(model="m", tensor_parallel_size=2, distributed_init_method=f"tcp://10.0.0.1:{port}")
    configs = replica_configs(split, replicas)
    assert [c.distributed_init_method for c in configs] == [f"tcp://10.0.0.1:{port + i}" for i in range(replicas)]
    assert all(c.data_parallel_size == 1 for c in configs)
    with pytest.raises(ValueError, match="past 65535"):
        replica_configs(EngineConfig(model="m", tensor_parallel_size=2, distributed_init_method="tcp://h:65535"), 2)
    whole = EngineConfig(model="m", distributed_init_method=f"tcp://10.0.0.1:{port}")  # no ranks: nothing meets
    assert replica_configs(whole, replicas) == [whole] * replicas


def test_replica_d_holds_world_ranks_d_times_t_to_the_next():
    replicas, split = random.randint(1, 5), random.randint(1, 5)
    layout = replica_world_ranks(replicas, split)
    assert len(layout) == replicas and all(len(ranks) == split for ranks in layout)
    assert sorted(r for ranks in layout for r in ranks) == list(range(replicas * split))
    for d, ranks in enumerate(layout):
        assert all(rank // split == d for rank in ranks) and ranks == sorted(ranks)


def test_the_command_line_refuses_remote_replicas_sharing_experts_without_a_meeting_address(tmp_path):
    """Without --engines-share-experts the --engine replicas stay independent (the combination is accepted)."""
    from engine.engine_flags import engine_config
    from gateway.cli import build_parser

    alone = ["serve", "--model", "m", "--enable-expert-parallel", "--tensor-parallel-size", "2",
             "--distributed-init-method", "tcp://10.0.0.1:29500", "--engine", "10.0.0.2:7000"]
    args = build_parser().parse_args(alone)
    assert not args.engines_share_experts
    assert replica_configs(engine_config(args), 1, 0)[0].data_parallel_size == 1
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--model", str(tmp_path), "--database-url",
                          f"sqlite:///{tmp_path}/p.db", "--data-parallel-size", "2", "--enable-expert-parallel",
                          "--tensor-parallel-size", "2", "--engine", "127.0.0.1:1", "--engines-share-experts"],
                         capture_output=True, text=True,
                         timeout=60, env={**os.environ, "MOEGATE_ENGINE_KEY": "k" * 16})
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "--distributed-init-method" in run.stderr, run.stderr


def test_a_model_that_cannot_be_split_so_is_refused_before_anything_is_written(tmp_path):
    """The demo model's 4 query heads do not divide over 3 ranks; its experts over 2 x 2 ranks do."""
    import subprocess
    import sys

    from engine.core.config import EngineConfig
    from engine.loading.split_check import check_split
    from engine.loading.demo_model import write_demo_model
    from engine.core.model_config import load_model_config

    model = str(tmp_path / "model")
    write_demo_model(model, seed=0)
    config = load_model_config(model)
    run = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--model", model, "--database-url",
                          f"sqlite:///{tmp_path}/p.db", "--tensor-parallel-size", "3"], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "divisible" in run.stderr, run.stderr
    assert not (tmp_path / "p.db").exists()
    check_split(config, EngineConfig(model=model, tensor_parallel_size=2, enable_expert_parallel=True,
                                     data_parallel_size=2, distributed_init_method="tcp://127.0.0.1:1"))
    with pytest.raises(ValueError, match="experts"):
        check_split(config, EngineConfig(model=model, enable_expert_parallel=True, data_parallel_size=1024,
                                         distributed_init_method="tcp://127.0.0.1:1"))


def test_independent_replicas_each_keep_their_own_disk_cache_directory(tmp_path):
    replicas = random.randint(2, 5)
    config = EngineConfig(model="m", host_cache_gb=1, disk_cache_dir=str(tmp_path), disk_cache_gb=2)
    dirs = [c.disk_cache_dir for c in replica_configs(config, replicas)]
    assert dirs == [os.path.join(str(tmp_path), f"replica-{i}") for i in range(replicas)]
    assert replica_configs(config, 1)[0].disk_cache_dir == str(tmp_path)
