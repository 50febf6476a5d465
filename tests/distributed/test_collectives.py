"""Tensor-parallel collectives on real gloo ranks: sums and gathers against float64, the plan broadcast, the rank
messages' bytes, and a dead peer failing the survivor within its timeout with a message that names it (never a
hang)."""

import random
import time

import pytest

from tests.distributed.ranks import free_port, run_ranks


def _collectives(rank: int, world: int, address: str, seed: int):
    import torch

    from engine.distributed.collectives import TensorParallel
    from engine.distributed.groups import RankGroups, RankInfo

    groups = RankGroups(RankInfo(rank, world, rank, address), torch.device("cpu"), timeout_s=20)
    tp = TensorParallel(groups)
    gen = torch.Generator().manual_seed(seed)
    every = [torch.randn(3, 5, generator=gen, dtype=torch.float32) for _ in range(world)]  # each rank's part
    summed = tp.all_reduce(every[rank].clone())
    gathered = tp.all_gather(every[rank].clone(), dim=-1)
    plan = tp.broadcast_object({"step": seed, "ids": [1, 2, 3]} if rank == 0 else None)
    # The rank messages' bytes (engine.worker.rank_messages): rank 0's, of a length the others do not know.
    data = tp.broadcast_bytes(random.Random(seed).randbytes(seed % 5000 + 1) if rank == 0 else None)
    groups.close()
    want_sum = torch.stack([p.double() for p in every]).sum(0)
    return {
        "sum_err": (summed.double() - want_sum).abs().max().item(),
        "gather_ok": torch.equal(gathered, torch.cat(every, dim=-1)),
        "plan": plan,
        "bytes": data,
        "shard": tp.shard(12, "heads"),
    }


def test_all_reduce_all_gather_and_plan_broadcast_on_three_ranks():
    seed = random.randrange(2**31)
    results = run_ranks(_collectives, 3, seed, timeout_s=120)
    assert sorted(results) == [0, 1, 2], results
    for rank, (status, value) in results.items():
        assert status == "ok", value
        assert value["sum_err"] < 1e-5, (seed, value)
        assert value["gather_ok"] and value["plan"] == {"step": seed, "ids": [1, 2, 3]}
        assert value["bytes"] == random.Random(seed).randbytes(seed % 5000 + 1), seed
        assert value["shard"] == (4 * rank, 4)


def _peer_dies(rank: int, world: int, address: str):
    import os

    import torch

    from engine.distributed.collectives import TensorParallel
    from engine.distributed.groups import CollectiveError, RankGroups, RankInfo

    groups = RankGroups(RankInfo(rank, world, rank, address), torch.device("cpu"), timeout_s=3)
    tp = TensorParallel(groups)
    tp.all_reduce(torch.ones(4))  # both ranks are up
    if rank == 1:
        os._exit(0)  # dies without a word, as a crashed or killed rank would
    start = time.monotonic()
    try:
        tp.all_reduce(torch.ones(4))
    except CollectiveError as e:
        return {"message": str(e), "seconds": time.monotonic() - start}
    return {"message": None, "seconds": time.monotonic() - start}


def test_a_dead_peer_fails_the_survivor_within_the_timeout_naming_its_rank():
    results = run_ranks(_peer_dies, 2, timeout_s=60)
    status, value = results[0]
    assert status == "ok", value
    assert value["message"] is not None and value["message"].startswith("rank 0 of 2: all_reduce"), value
    assert value["seconds"] < 15, value


def test_rank_info_from_the_torchrun_environment():
    from engine.distributed.groups import RankInfo

    env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29500"}
    assert RankInfo.from_env(env) == RankInfo(1, 4, 1, "tcp://10.0.0.2:29500")
    with pytest.raises(ValueError, match="MASTER_PORT is not set"):
        RankInfo.from_env({k: v for k, v in env.items() if k != "MASTER_PORT"})
    with pytest.raises(ValueError, match="must be integers"):
        RankInfo.from_env({**env, "RANK": "one"})
    with pytest.raises(ValueError, match="rank 4 is not in a world of 4"):
        RankInfo.from_env({**env, "RANK": "4"})


def test_ranks_that_never_arrive_are_named_when_the_meeting_times_out(capfd):
    """Rank 0 alone in a world of 3: after the join timeout it fails naming ranks 1 and 2, without the two
    c10d warnings per poll that waiting on the store with a short timeout used to print."""
    import torch

    from engine.distributed.groups import CollectiveError, RankGroups, RankInfo

    address = f"tcp://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(CollectiveError, match=r"rank\(s\) 1, 2 did not arrive"):
        RankGroups(RankInfo(0, 3, 0, address), torch.device("cpu"), join_timeout_s=1.5)
    assert 1.5 <= time.monotonic() - start < 10
    assert "waitForInput" not in capfd.readouterr().err


def test_ctrl_c_ends_a_rank_waiting_for_its_group_at_once():
    """Python would only see the interrupt once torch's rendezvous returned (after its 5-minute timeout)."""
    import os
    import select
    import signal
    import subprocess
    import sys

    env = {**os.environ, "RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}  # nobody hosts the meeting there
    rank = subprocess.Popen([sys.executable, "-m", "gateway.cli", "engine-rank"], env=env, stderr=subprocess.PIPE,
                            text=True)
    try:
        said = []  # its lines up to the one saying it waits for its group (after its imports: seconds under load)
        while not any("waiting for its group" in line for line in said):
            assert select.select([rank.stderr], [], [], 120)[0], "".join(said)[-2000:]  # silent for two minutes
            line = rank.stderr.readline()
            assert line, "".join(said)[-2000:]  # ended before reaching the rendezvous
            said.append(line)
        time.sleep(random.uniform(0.5, 1.5))  # into the rendezvous itself
        assert rank.poll() is None
        rank.send_signal(signal.SIGINT)
        _, err = rank.communicate(timeout=10)
    finally:
        if rank.poll() is None:
            rank.kill()
    assert rank.returncode == -signal.SIGINT, err[-2000:]  # ended by the signal itself
    assert "Traceback" not in err
