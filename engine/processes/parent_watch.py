"""Processes that must not outlive the process that started them."""

import multiprocessing
import multiprocessing.connection
import os
import threading
import time


def exit_with_parent(parent: int | None = None, poll_s: float = 0.5) -> None:
    """End this process (at once, exit code 1) when the process that started it is gone, killed or crashed:
    an engine process or rank blocked in a collective or a rendezvous would otherwise hold its memory and
    devices until a timeout of its own. Watches from a daemon thread.

    ``parent``: the starter's process id, as the starter gave it (polled every ``poll_s``); None: the starter of
    this ``multiprocessing`` child (spawned, or forked by a forkserver: ``engine.processes.process_start``), watched
    through the pipe it holds open for as long as it lives, which closes when it ends, however. Not this process's
    parent id as it reads now: a forkserver's child has the server as its parent, and a starter that died while
    this process was still starting up (importing torch takes seconds) has already handed it to init."""
    if parent is None:
        starter = multiprocessing.parent_process()
        if starter is None:
            raise ValueError("exit_with_parent: not a multiprocessing child; pass the parent's process id")
        if not starter.is_alive():
            os._exit(1)  # gone already

        def watch_pipe() -> None:
            multiprocessing.connection.wait([starter.sentinel])  # returns when the starter's end closes
            os._exit(1)

        threading.Thread(target=watch_pipe, name="moegate-parent-watch", daemon=True).start()
        return
    if os.getppid() != parent:
        os._exit(1)  # gone already

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="moegate-parent-watch", daemon=True).start()
