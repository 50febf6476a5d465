"""Engine processes forked from the forkserver take the starting process's environment as it is at the start
(not the server's, from when it started), with their own overrides, and import nothing the server did not; the
server imports the extra modules the first start asked for, and a later start's are not imported."""

import ast
import multiprocessing
import os
import random
import subprocess
import sys

import pytest

from engine.processes.process_start import START_METHOD_ENV, process_context, start_process


def report(conn, names: list[str]) -> None:
    import sys

    conn.send({"env": {n: os.environ.get(n) for n in names}, "torch": "torch" in sys.modules,
               "parent": multiprocessing.parent_process().pid})
    conn.close()


def imported(conn, names: list[str]) -> None:
    import sys

    conn.send({name: name in sys.modules for name in names})
    conn.close()


def _run(names: list[str], env: dict[str, str] | None = None) -> dict:
    ours, theirs = multiprocessing.Pipe(duplex=False)
    process = start_process(report, (theirs, names), "reporter", env)
    theirs.close()
    try:
        assert ours.poll(60), "the process never reported"
        return ours.recv()
    finally:
        process.join(10)
        assert process.exitcode == 0


def test_the_environment_is_the_starters_at_the_start_with_the_overrides(monkeypatch):
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    first = _run([])  # the forkserver is up now, with this environment
    assert first["torch"] and first["parent"] == os.getpid()  # preloaded; the starter is its parent process
    value, override = str(random.random()), str(random.random())
    monkeypatch.setenv("MOEGATE_TEST_LATER", value)  # set after the server started
    monkeypatch.setenv("MOEGATE_TEST_OVERRIDDEN", "starter's")
    got = _run(["MOEGATE_TEST_LATER", "MOEGATE_TEST_OVERRIDDEN", "MOEGATE_TEST_ABSENT"],
               {"MOEGATE_TEST_OVERRIDDEN": override})
    assert got["env"] == {"MOEGATE_TEST_LATER": value, "MOEGATE_TEST_OVERRIDDEN": override,
                          "MOEGATE_TEST_ABSENT": None}
    assert os.environ["MOEGATE_TEST_OVERRIDDEN"] == "starter's"  # the override is the child's alone


def test_the_start_method_is_checked(monkeypatch):
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    with pytest.raises(ValueError, match=f"{START_METHOD_ENV} must be one of forkserver, spawn"):
        process_context()
    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    assert process_context().get_start_method() == "spawn"


def test_the_first_start_s_extra_preload_is_imported_by_the_server():
    """In a fresh test process (whose first start starts the server): two stdlib modules nothing here imports."""
    first, later = random.sample(["graphlib", "sched"], 2)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    starter = ("import multiprocessing\n"
               "from engine.processes.process_start import start_process\n"
               "from tests.engine.processes.test_process_start import imported\n"
               "def run(preload):\n"
               "    ours, theirs = multiprocessing.Pipe(duplex=False)\n"
               "    process = start_process(imported, (theirs, [%r, %r]), 'reporter', preload=preload)\n"
               "    theirs.close()\n"
               "    got = ours.recv()\n"
               "    process.join(10)\n"
               "    return got\n"
               "print([run((%r,)), run((%r,))])\n" % (first, later, first, later))
    env = {**os.environ, "PYTHONPATH": root}
    env.pop(START_METHOD_ENV, None)
    run = subprocess.run([sys.executable, "-c", starter], cwd=root, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    want = {first: True, later: False}  # the later start's module: imported by neither process
    assert ast.literal_eval(run.stdout) == [want, want]
