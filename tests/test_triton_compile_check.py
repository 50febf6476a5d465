"""benchmarks.triton_compile_check: Triton launches compiled for sm_90 on a machine with no GPU.

The interpreter that runs the kernels in CI accepts a ``tl.dot`` of 8 x 8 tiles; the GPU compiler refuses it.
The check must report that launch and pass the same kernel at 16 x 16, and its recorder must write down the
real launches of a kernel test (the LoRA delta kernel's, whose rank tile is widened to 16 for ``tl.dot``).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(300)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    return {**env, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}


def test_a_dot_under_16_is_refused_and_16_compiles(tmp_path):
    launches = tmp_path / "launches.jsonl"
    launches.write_text("".join(json.dumps({
        "module": "tests.triton_dot_probe", "kernel": "dot_tile_kernel", "signature": {
            "x_ptr": "*bf16", "y_ptr": "*fp32", "BLOCK": "constexpr"}, "constexprs": {"BLOCK": block},
        "num_warps": 4, "num_stages": 2}) + "\n" for block in (16, 8)))
    done = subprocess.run([sys.executable, "-m", "benchmarks.triton_compile_check", "--compile-only", str(launches)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 of 2 distinct launches compile for sm_90" in done.stdout, done.stdout
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and "'BLOCK': 8" in failed[0] and "K >= 16" in failed[0], done.stdout


def test_the_recorder_writes_a_kernel_tests_launches_and_they_compile(tmp_path):
    keep = tmp_path / "launches.jsonl"
    done = subprocess.run([sys.executable, "-m", "benchmarks.triton_compile_check", "--keep", str(keep),
                           "tests/engine/kernels/test_lora_experts_kernel.py"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in keep.read_text().splitlines()]
    assert {r["kernel"] for r in records} == {"expert_lora_delta_kernel"}, records
    assert {r["signature"]["x_ptr"] for r in records} == {"*fp32", "*bf16"}  # the test's two dtypes
    assert all(r["constexprs"]["BLOCK_R"] >= 16 for r in records)
    assert f"{len(records)} of {len(records)} distinct launches compile" in done.stdout
