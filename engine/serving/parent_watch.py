"""Processes that must not outlive the process that started them."""

import os
import threading
import time


def exit_with_parent(poll_s: float = 0.5) -> None:
    """End this process (at once, exit code 1) when the process that started it is gone, killed or crashed:
    an engine process or rank blocked in a collective or a rendezvous would otherwise hold its memory and
    devices until a timeout of its own. Polls the parent's id from a daemon thread."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="moegate-parent-watch", daemon=True).start()
