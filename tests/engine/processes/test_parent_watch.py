"""Engine processes and ranks end with the process that started them, even when it died while they were still
starting up (before they began to watch it)."""

import os
import random
import subprocess
import sys
import time

import pytest

from engine.processes.process_start import START_METHOD_ENV
from tests.processes import is_running

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def late_watcher(delay_s: float) -> None:
    """A spawned child that starts watching its parent only after ``delay_s`` (an engine importing torch)."""
    time.sleep(delay_s)
    from engine.processes.parent_watch import exit_with_parent

    exit_with_parent()
    time.sleep(60)


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_an_engine_process_whose_starter_died_during_its_start_up_ends(method):
    """Started as the gateway starts engine processes (a forkserver's child has the server, which lives on a
    moment, as its parent process: the watch must follow the starter, not the parent id)."""
    delay = random.uniform(1.0, 2.0)
    starter = ("import os\n"
               "from engine.processes.process_start import start_process\n"
               "from tests.engine.processes.test_parent_watch import late_watcher\n"
               "child = start_process(late_watcher, (%r,), 'watcher')\n"
               "print(child.pid, flush=True)\n"
               "os._exit(0)\n" % delay)  # gone at once, without waiting for its child
    # Read, not run to the end: the child holds the starter's stdout open as long as it lives.
    with subprocess.Popen([sys.executable, "-c", starter], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT, START_METHOD_ENV: method}) as starting:
        child = int(starting.stdout.readline())
        starting.wait(timeout=30)
    try:
        deadline = time.monotonic() + delay + 10  # its own start-up, the delay, then one poll
        while is_running(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not is_running(child), "the child outlived its parent"
    finally:
        if is_running(child):
            os.kill(child, 9)


def test_a_process_given_a_parent_that_is_gone_ends_at_once():
    """A follower rank is told its engine process's id; if that process has ended, the rank ends."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    code = f"from engine.processes.parent_watch import exit_with_parent\nexit_with_parent({gone.pid})\nimport time\ntime.sleep(30)"
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=40, env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 1 and time.monotonic() - t0 < 20
