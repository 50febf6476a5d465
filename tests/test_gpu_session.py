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
    assert {"tests", "bench-engine", "bench-mla", "bench-engine-deepseek", "bench-engine-families"} <= set(stages)
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
