"""The offline LLM over 2 ranks, used several times in one process: closed by close(), by a with-block, when
collected, and when the interpreter exits; each time the ranks end and the next LLM forms its own group (it
used to fail: "trying to initialize the default process group twice"). Greedy tokens the same each time."""

import json
import random
import subprocess
import sys
import time

import pytest

from tests.hf_models import make_hf_model
from tests.processes import is_running

SCRIPT = r"""
import gc, json, os, sys
from engine import LLM, SamplingParams
from tests.processes import is_running, rank_pids

model = sys.argv[1]
engine = dict(device="cpu", cpu_threads=1, num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=2,
              tensor_parallel_size=2)
params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
prompt = [json.loads(sys.argv[2])]
out = {}
with LLM(model, **engine) as llm:
    out["with"] = llm.generate(prompt, params)[0].token_ids
    ranks = rank_pids(os.getpid())
out["with ranks ended"] = bool(ranks) and not any(is_running(p) for p in ranks)
try:
    llm.generate(prompt, params)
except RuntimeError as e:
    out["after close"] = str(e)
dropped = LLM(model, **engine)
out["dropped"] = dropped.generate(prompt, params)[0].token_ids
del dropped
gc.collect()
last = LLM(model, **engine)  # never closed: the interpreter's exit closes it
out["last"] = last.generate(prompt, params)[0].token_ids
out["last ranks"] = rank_pids(os.getpid())
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.timeout(240)
def test_llm_closes_its_ranks_every_way(tmp_path):
    make_hf_model("mixtral", str(tmp_path), seed=random.randrange(2**31), vocab_size=97, num_layers=2)
    prompt = [random.randrange(1, 96) for _ in range(5)]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), json.dumps(prompt)], capture_output=True,
                          text=True, timeout=200)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[0][len("RESULT "):])
    assert len(out["with"]) == 3 and out["dropped"] == out["with"] and out["last"] == out["with"], out
    assert out["with ranks ended"] and "closed" in out["after close"], out
    deadline = time.monotonic() + 10  # the exit's close waited for them; reaped by init once orphaned
    while any(is_running(p) for p in out["last ranks"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert out["last ranks"] and not any(is_running(p) for p in out["last ranks"]), out
