"""Run a function on N gloo ranks in fresh processes (one torch thread each), with a hard time limit."""

import multiprocessing
import queue
import socket
import time
import traceback


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
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
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
