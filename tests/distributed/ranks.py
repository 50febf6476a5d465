"""Run a function on N gloo ranks in processes of their own (one torch thread each), with a hard time limit; or
several runs of it (one per family, say) in one set of processes, so that their start-up is paid once.

The ranks start as the engine's own processes do (``engine.processes.process_start.start_process``): forked from a
forkserver that imported torch and the engine once per test process (a spawned rank spent 3-4 s of CPU importing
them, the largest part of a small distributed test's time), with the test process's environment at the start.
"""

import queue
import socket
import time
import traceback
from collections.abc import Callable

from engine.processes.process_start import process_context, start_process

# A rank unpickles its function by importing the test module it lives in, which imports pytest and the reference
# models (transformers' model classes): preloaded as well, a rank starts on about half the CPU (0.1-0.2 s rather than
# 0.3-1 s). The forkserver imports them only if a rank's start is the test process's first start (its first
# ``run_ranks``, before any engine started its processes): otherwise each rank imports them itself, as a spawned
# one would.
TEST_PRELOAD = ("pytest", "tests.hf_models")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, world: int, port: int, args, results) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        results.put((rank, "ok", fn(rank, world, f"tcp://127.0.0.1:{port}", *args)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_ranks(fn, world: int, *args, timeout_s: float = 120.0) -> dict[int, tuple[str, object]]:
    """{rank: ("ok", fn's result) or ("error", message)}; ranks still alive after ``timeout_s`` are killed."""
    results = process_context(TEST_PRELOAD).Queue()
    port = free_port()
    procs = [start_process(_entry, (fn, r, world, port, args, results), f"test-rank-{r}", preload=TEST_PRELOAD)
             for r in range(world)]
    out: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        # Until every rank answered, the time is up, or every rank has exited (one that died answers never).
        while len(out) < world and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                if not any(p.is_alive() for p in procs) and results.empty():
                    break
                continue
            out[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return out


def _each_run(rank: int, world: int, address: str, fn: Callable, runs: dict) -> dict:
    """``fn`` for every run in turn in this process, each run's ranks meeting at their own port; one that fails
    leaves the others' results: {name: ("ok", result) or ("error", message)}."""
    out = {}
    for name, (port, args) in runs.items():
        try:
            out[name] = ("ok", fn(rank, world, f"tcp://127.0.0.1:{port}", *args))
        except Exception as e:  # noqa: BLE001 - reported to that run's test
            out[name] = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    return out


def run_ranks_each(fn, world: int, runs: dict[str, tuple], timeout_s: float = 120.0) -> dict[str, dict[int, tuple]]:
    """``fn(rank, world, address, *args)`` for every ``name: args`` of ``runs``, one after another in one set of
    ``world`` rank processes (started, and their imports paid, once rather than once a run): {name: what
    ``run_ranks`` would give for that run alone}; ranks still alive after ``timeout_s`` (all runs) are killed."""
    tagged = {name: (free_port(), args) for name, args in runs.items()}
    results = run_ranks(_each_run, world, fn, tagged, timeout_s=timeout_s)
    return {name: {rank: value[name] if status == "ok" else (status, value) for rank, (status, value) in results.items()}
            for name in runs}
