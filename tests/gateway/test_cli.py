"""The moegate command line: bad input gets exit code 2 and one line on stderr."""

import subprocess
import sys


def moegate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True, timeout=120)


def test_serve_with_missing_model_is_one_line_exit_2(tmp_path):
    r = moegate("serve", "--model", str(tmp_path / "nope"))
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "not a directory" in r.stderr


def test_serve_with_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    r = moegate("serve", "--model", str(tmp_path))
    assert r.returncode == 2 and "unsupported architecture" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_loadgen_rejects_unknown_system():
    r = moegate("loadgen", "offline", "--systems", "moegate,vllm")
    assert r.returncode == 2 and "unknown systems" in r.stderr and "Traceback" not in r.stderr


def test_usage_errors_exit_2():
    r = moegate("serve")
    assert r.returncode == 2 and "--model" in r.stderr
