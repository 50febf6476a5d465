"""`moegate run-batch`: the Batch API format offline; results equal the offline engine's."""

import json
import random
import subprocess
import sys

from engine import LLM, SamplingParams
from engine.loading.demo_model import write_demo_model
from gateway.cli import main


def _moegate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True, timeout=300)


def test_run_batch_matches_the_offline_engine_and_reports_bad_input(tmp_path, capsys):
    rng = random.Random()
    model = str(tmp_path / "model")
    write_demo_model(model, seed=rng.randrange(1000))
    prompts = [f"offline {rng.randrange(10**6)} #{i}" for i in range(6)]
    lengths = [rng.randint(2, 9) for _ in prompts]
    lines = [{"custom_id": f"id-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "m", "prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True}}
             for i, (p, n) in enumerate(zip(prompts, lengths))]
    # Several prompts with n=2 in one line: prompt p's copies are choices 2p and 2p+1.
    lines.append({"custom_id": "multi", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "m", "prompt": prompts[:2], "n": 2, "max_tokens": 3, "temperature": 0,
                           "ignore_eos": True}})
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(l) for l in lines) + "\n")
    done = _moegate("run-batch", "-i", str(src), "-o", str(out), "--model", model, "--no-progress")
    assert done.returncode == 0, done.stderr[-2000:]
    got = [json.loads(l) for l in out.read_text().splitlines()]
    assert [g["custom_id"] for g in got] == [l["custom_id"] for l in lines]  # input order
    llm = LLM(model=model)
    for g, p, n in zip(got, prompts, lengths):
        ref = llm.generate([p], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]
        assert g["response"]["status_code"] == 200 and g["error"] is None
        assert g["response"]["body"]["choices"][0]["text"] == ref.text
        assert g["response"]["body"]["usage"]["completion_tokens"] == n
    multi = got[-1]["response"]["body"]
    refs = llm.generate(prompts[:2], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert [(c["index"], c["text"]) for c in multi["choices"]] == [(i, refs[i // 2].text) for i in range(4)]
    assert multi["usage"]["completion_tokens"] == 12
    assert multi["usage"]["prompt_tokens"] == sum(r.num_prompt_tokens for r in refs)

    # Bad input is refused before anything runs, checked in this process (main's return value is the exit code; the
    # console script's own exit is the run's above): an interpreter a case costs 2-5 s of CPU importing torch.
    capsys.readouterr()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(lines[0]) + "\n{oops\n" + json.dumps(lines[0]) + "\n")
    assert main(["run-batch", "-i", str(bad), "-o", str(tmp_path / "x.jsonl"), "--model", model]) == 2
    err = capsys.readouterr().err
    assert ":2: invalid_json_line" in err and ":3: duplicate_custom_id" in err, err
    assert not (tmp_path / "x.jsonl").exists()  # nothing ran
    assert main(["run-batch", "-i", str(tmp_path / "nope.jsonl"), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "nope.jsonl" in err, err
