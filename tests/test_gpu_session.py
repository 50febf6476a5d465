"""benchmarks/gpu_session.sh is ready before a GPU is lent: every stage's commands import and parse their arguments.

The dry run records each ``$PY -m MODULE ARGS`` a stage would run (as the shell expands it) and parses the
arguments with the module's own parser, so a typo in a flag or a module costs a CI failure, not GPU minutes.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import dry_run

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"

pytestmark = pytest.mark.timeout(180)


def _stages() -> list[str]:
    return re.findall(r"^\s+([a-z0-9-]+)\) run_stage", SCRIPT.read_text(), re.M)


def test_every_stage_parses_its_commands():
    stages = _stages()
    assert {"tests-cuda", "tests-paths", "goal-engine", "goal-moe", "goal-hf", "bench-mla",
            "bench-engine-families"} <= set(stages)
    listed = subprocess.run(["bash", str(SCRIPT), "--list"], capture_output=True, text=True, timeout=30).stdout
    assert sorted(stages) == sorted(line.split()[0] for line in listed.splitlines()[1:-1])  # each has a table row
    env = {**os.environ, "PY": sys.executable, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(["bash", str(SCRIPT), "--dry-run", *stages], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=150)
    assert done.returncode == 0, done.stdout + done.stderr
    parsed = re.search(r"dry run: (\d+) of (\d+) commands parse", done.stdout)
    assert parsed and parsed.group(1) == parsed.group(2) and int(parsed.group(2)) >= len(stages), done.stdout


def test_a_flag_the_benchmark_does_not_take_fails_the_dry_run(tmp_path, capsys):
    commands = tmp_path / "commands.jsonl"
    commands.write_text(json.dumps({"module": "benchmarks.dense_gemv", "args": ["--json", "x.json"]}) + "\n"
                        + json.dumps({"module": "benchmarks.dense_gemv", "args": ["--no-such-flag"]}) + "\n"
                        + json.dumps({"module": "benchmarks.no_such_module", "args": []}) + "\n")
    assert dry_run.check(str(commands)) == 1
    out = capsys.readouterr().out
    assert "unrecognized arguments: --no-such-flag" in out and "benchmarks.no_such_module: cannot import" in out
    assert "1 of 3 commands parse" in out


def test_a_stage_that_no_longer_fits_the_budget_is_skipped_and_named_for_the_next_call(tmp_path):
    # No wheels to install, whatever this checkout's .whl/ holds.
    env = {**os.environ, "PY": sys.executable, "OUT": str(tmp_path), "WHEELS": str(tmp_path / "no-wheels")}
    done = subprocess.run(["bash", str(SCRIPT), "--budget", "10", "--stages", "env,goal-moe:100"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split("\t") for line in (tmp_path / "stages.tsv").read_text().splitlines()]
    assert rows[0][:3] == ["stage", "status", "rc"]
    assert [(r[0], r[1], r[5]) for r in rows[1:]] == [("env", "skipped", "60"), ("goal-moe", "skipped", "100")]
    assert "gpu_session.sh --budget 240 --stages env,goal-moe" in done.stdout
    assert (tmp_path / "gpu_session.tgz").exists()


@pytest.mark.parametrize("args, message", [(["--budget", "8m"], "--budget must be whole seconds"),
                                           (["--stages", "env,nope"], "unknown stage nope"),
                                           (["env:ten"], "bad limit in env:ten")])
def test_bad_arguments_exit_2_with_one_line(args, message):
    done = subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_a_missing_test_path_fails_the_dry_run(tmp_path, capsys):
    commands = tmp_path / "commands.jsonl"
    commands.write_text(json.dumps({"module": "pytest", "args": ["-q", "-k", "cuda", "tests/test_gpu_session.py"]}) + "\n"
                        + json.dumps({"module": "pytest", "args": ["tests/no_such_test.py"]}) + "\n"
                        + json.dumps({"module": "pytest", "args": ["tests/test_gpu_session.py::test_no_such"]}) + "\n")
    assert dry_run.check(str(commands)) == 1
    out = capsys.readouterr().out
    assert "no such test path: tests/no_such_test.py" in out and "defines no test_no_such" in out
    assert "1 of 3 commands parse" in out
