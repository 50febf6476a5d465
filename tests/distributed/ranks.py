"""Run a function on N gloo ranks in processes of their own (one torch thread each), with a hard time limit; or
several runs of it (one per family, say) in one set of processes, so that their start-up is paid once.

The ranks start as the engine's own processes do (``engine.processes.process_start.start_process``): forked from a
forkserver that imported torch and the engine once per test process (a spawned rank spent 3-4 s of CPU importing
them, the largest part of a small distributed test's time), with the test process's environment at the start.

The rank processes outlive a run: rank r of every run in a test process is the same process while it stays clean
(its function returned, left no process group and no child process running), so what a rank pays once is paid
once per test process, not once per test: above all the forkserver it starts for the engines' follower ranks
(another 4-5 s of CPU importing torch and the engine). A rank that failed, was killed at the time limit, died, or
left something behind is ended and replaced by a fresh one at the next run. Each run takes the test process's
environment and working directory as they are when it starts.
"""

import atexit
import multiprocessing.connection
import os
import socket
import time
import traceback
from collections.abc import Callable

from engine.processes.process_start import start_process

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


def _serve(rank: int, conn) -> None:
    """A rank process: run each task ``conn`` brings, answer ``((status, value), clean)``; end once not clean
    (its state may be anything: the test process starts a fresh rank) or when the test process closes ``conn``."""
    import multiprocessing

    import torch
    import torch.distributed as dist

    while True:
        try:
            fn, world, port, args, environ, cwd = conn.recv()
        except EOFError:
            return
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        torch.set_num_threads(1)
        try:
            answer = ("ok", fn(rank, world, f"tcp://127.0.0.1:{port}", *args))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            answer = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        clean = answer[0] == "ok" and not dist.is_initialized() and not multiprocessing.active_children()
        try:
            conn.send((answer, clean))
        except Exception as e:  # noqa: BLE001 - a value that does not pickle
            conn.send((("error", f"the result could not be sent: {type(e).__name__}: {e}"), False))
            return
        if not clean:
            return


class _Rank:
    """A rank process and the test process's end of its connection."""

    def __init__(self, rank: int) -> None:
        ours, theirs = multiprocessing.Pipe()
        self.process = start_process(_serve, (rank, theirs), f"test-rank-{rank}", preload=TEST_PRELOAD)
        theirs.close()
        self.conn = ours

    def end(self, timeout_s: float) -> None:
        """Ask it to end (its connection closes), kill it if it has not after ``timeout_s``."""
        self.conn.close()
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


_ranks: dict[int, _Rank] = {}  # rank -> its live, clean process, kept between runs


def _rank(rank: int) -> _Rank:
    """Rank ``rank``'s process: the kept one if it is still alive, else a fresh one."""
    kept = _ranks.get(rank)
    if kept is not None and not kept.process.is_alive():
        kept.end(0)
        kept = None
    if kept is None:
        kept = _ranks[rank] = _Rank(rank)
    return kept


def _retire(rank: int, timeout_s: float) -> None:
    if (kept := _ranks.pop(rank, None)) is not None:
        kept.end(timeout_s)


@atexit.register
def _end_ranks() -> None:
    for rank in list(_ranks):
        _retire(rank, 5)


def run_ranks(fn, world: int, *args, timeout_s: float = 120.0) -> dict[int, tuple[str, object]]:
    """{rank: ("ok", fn's result) or ("error", message)}; ranks still running after ``timeout_s`` are killed (a
    rank that died answers nothing)."""
    port = free_port()
    task = (fn, world, port, args, dict(os.environ), os.getcwd())
    running: dict[int, _Rank] = {}
    for r in range(world):
        running[r] = _rank(r)
        try:
            running[r].conn.send(task)
        except OSError:  # it ended since it was last seen alive
            _retire(r, 0)
            running[r] = _rank(r)
            running[r].conn.send(task)
    out: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        # Until every rank answered or died, or the time is up.
        while running and (left := deadline - time.monotonic()) > 0:
            watched = {rank.conn: r for r, rank in running.items()}
            watched.update({rank.process.sentinel: r for r, rank in running.items()})
            for ready in multiprocessing.connection.wait(list(watched), timeout=left):
                r = watched[ready]
                rank = running.pop(r, None)
                if rank is None:  # its connection and its sentinel were both ready
                    continue
                try:
                    # A rank that died may still have answered: its answer waits in the connection.
                    answer, clean = rank.conn.recv() if rank.conn.poll() else (None, False)
                except (EOFError, OSError):
                    answer, clean = None, False
                if answer is not None:
                    out[r] = answer
                if not clean:
                    _retire(r, 5)
    finally:
        for r in running:  # still running at the time limit (or the test was interrupted)
            _retire(r, 0)
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
