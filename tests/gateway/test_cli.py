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
    r = moegate("serve", "--port", "not-a-port")
    assert r.returncode == 2 and "--port" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = moegate("loadgen", "offline", "--num-requests", "x")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_serve_checks_weights_and_upgrades_embedded_sqlite(tmp_path):
    """Missing weights are bad input (exit 2); an embedded SQLite schema is brought to head on the way."""
    from tenants.migrate import current_revision

    db = f"sqlite:///{tmp_path / 'policy.db'}"
    cfg = tmp_path / "m"
    cfg.mkdir()
    (cfg / "config.json").write_text('{"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}')
    r = moegate("serve", "--model", str(cfg), "--database-url", db)
    assert r.returncode == 2 and "no *.safetensors" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert current_revision(db) is None  # checked before touching the database
