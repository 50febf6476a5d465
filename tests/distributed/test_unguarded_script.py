"""A user's script that builds ``LLM(..., tensor_parallel_size=2)`` at top level, without an
``if __name__ == "__main__":`` guard (as the README's offline example is written), run as a file: its ranks must
not run the script again (they used to, each failing with a page of multiprocessing errors). Reference: the same
prompts on one rank (TP=1) in this process; greedy tokens must be identical."""

import json
import random
import subprocess
import sys

import pytest

from engine import LLM, SamplingParams
from tests.hf_models import make_hf_model

SCRIPT = r"""
import json, sys
from engine import LLM, SamplingParams

print("BODY RAN", flush=True)
llm = LLM(sys.argv[1], device="cpu", cpu_threads=1, num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=2,
          tensor_parallel_size=2)
outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
print("RESULT " + json.dumps([o.token_ids for o in outs]), flush=True)
"""


@pytest.mark.timeout(240)
def test_a_script_without_a_main_guard_runs_tensor_parallel_once(tmp_path):
    model = tmp_path / "model"
    make_hf_model("mixtral", str(model), seed=random.randrange(2**31), vocab_size=97, num_layers=2)
    prompts = [[random.randrange(1, 96) for _ in range(random.randint(3, 9))] for _ in range(2)]
    script = tmp_path / "offline.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(model), json.dumps(prompts)], capture_output=True,
                          text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("BODY RAN") == 1, proc.stdout  # the ranks never ran the script's body
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    with LLM(str(model), device="cpu", cpu_threads=1, num_kv_blocks=16, max_num_batched_tokens=16,
             max_num_seqs=2) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4,
                                                                                ignore_eos=True))]
    assert lines and json.loads(lines[0][len("RESULT "):]) == expected
