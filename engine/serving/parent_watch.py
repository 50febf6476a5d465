"""Processes that must not outlive the process that started them."""

import multiprocessing
import os
import threading
import time


def exit_with_parent(parent: int | None = None, poll_s: float = 0.5) -> None:
    """End this process (at once, exit code 1) when the process that started it is gone, killed or crashed:
    an engine process or rank blocked in a collective or a rendezvous would otherwise hold its memory and
    devices until a timeout of its own. Polls the parent's id from a daemon thread.

    ``parent``: the starter's process id, as the starter gave it; None: the ``multiprocessing`` parent of a
    spawned process. Not this process's parent id as it reads now: a starter that died while this process was
    still starting up (importing torch takes seconds) has already handed it to init, and it would watch init."""
    if parent is None:
        spawner = multiprocessing.parent_process()
        if spawner is None:
            raise ValueError("exit_with_parent: not a multiprocessing child; pass the parent's process id")
        parent = spawner.pid
    if os.getppid() != parent:
        os._exit(1)  # gone already

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="moegate-parent-watch", daemon=True).start()
