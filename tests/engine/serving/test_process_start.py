"""Engine processes forked from the forkserver take the starting process's environment as it is at the start
(not the server's, from when it started), with their own overrides, and import nothing the server did not."""

import multiprocessing
import os
import random

import pytest

from engine.serving.process_start import START_METHOD_ENV, process_context, start_process


def report(conn, names: list[str]) -> None:
    import sys

    conn.send({"env": {n: os.environ.get(n) for n in names}, "torch": "torch" in sys.modules,
               "parent": multiprocessing.parent_process().pid})
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
