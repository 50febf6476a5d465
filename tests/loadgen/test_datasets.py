"""Datasets: length distributions, synthetic prompts of the asked length, ShareGPT files, shared prefixes."""

import itertools
import json
import random
import statistics

import pytest

from loadgen.datasets import DatasetConfig, LengthDist, iter_requests, load_sharegpt


def _take(config: DatasetConfig, n: int, seed: int = 0):
    return list(itertools.islice(iter_requests(config, seed), n))


def test_length_distributions():
    rng = random.Random(0)
    assert LengthDist.parse("128").sample(rng) == 128 and LengthDist.parse(64).sample(rng) == 64
    uni = [LengthDist.parse("uniform:16,512").sample(rng) for _ in range(4000)]
    assert min(uni) >= 16 and max(uni) <= 512 and statistics.mean(uni) == pytest.approx(264, rel=0.03)
    norm = [LengthDist.parse("normal:256,64").sample(rng) for _ in range(4000)]
    assert statistics.mean(norm) == pytest.approx(256, rel=0.02) and statistics.stdev(norm) == pytest.approx(64, rel=0.06)
    hist = LengthDist.parse("hist:10=3,100-200=1")
    xs = [hist.sample(rng) for _ in range(4000)]
    assert xs.count(10) / len(xs) == pytest.approx(0.75, abs=0.03)
    assert all(x == 10 or 100 <= x <= 200 for x in xs)
    assert hist.mean() == pytest.approx(0.75 * 10 + 0.25 * 150)


@pytest.mark.parametrize("text", ["uniform:5", "uniform:9,3", "normal:a,b", "gauss:1,2", "hist:", "hist:5-1=1", "0", "x"])
def test_bad_length_distributions(text):
    with pytest.raises(ValueError):
        LengthDist.parse(text)


def test_synthetic_prompts_have_the_asked_length_and_are_deterministic():
    cfg = DatasetConfig("synthetic", input_len="uniform:5,50", output_len="normal:20,5")
    reqs = _take(cfg, 50)
    assert all(len(r.prompt.split()) == r.input_len and 5 <= r.input_len <= 50 and r.max_tokens >= 1 for r in reqs)
    assert [r.prompt for r in reqs] == [r.prompt for r in _take(cfg, 50)]
    assert [r.prompt for r in reqs] != [r.prompt for r in _take(cfg, 50, seed=1)]
    assert len({r.prompt for r in reqs}) == 50


def test_exact_lengths_with_a_tokenizer(demo_model_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{demo_model_dir}/tokenizer.json")
    cfg = DatasetConfig("synthetic", input_len="uniform:8,200", output_len="16", tokenizer=demo_model_dir)
    for r in _take(cfg, 30):
        assert len(tok.encode(r.prompt, add_special_tokens=False).ids) == r.input_len


def test_sharegpt(tmp_path):
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "What is a mill?"}, {"from": "gpt", "value": "x" * 400}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "orphan reply"}]},  # no human turn first: skipped
        {"id": "c", "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "Hi"},
                                      {"from": "gpt", "value": "Hello there"}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    assert load_sharegpt(str(path)) == [("What is a mill?", "x" * 400), ("Hi", "Hello there")]
    reqs = _take(DatasetConfig("sharegpt", path=str(path)), 4)
    assert sorted(r.prompt for r in reqs) == ["Hi", "Hi", "What is a mill?", "What is a mill?"]  # each pass covers all
    assert {r.max_tokens for r in reqs if r.prompt != "Hi"} == {100}  # 400 characters at 4 a token
    fixed = _take(DatasetConfig("sharegpt", path=str(path), output_len="7", sharegpt_output_len=False), 3)
    assert {r.max_tokens for r in fixed} == {7}
    (tmp_path / "bad.json").write_text('{"not": "a list"}')
    with pytest.raises(ValueError, match="no ShareGPT"):
        load_sharegpt(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="cannot read"):
        load_sharegpt(str(tmp_path / "missing.json"))


def test_shared_prefix():
    cfg = DatasetConfig("shared-prefix", input_len="10", output_len="5", num_prefixes=3, prefix_len=40)
    reqs = _take(cfg, 60)
    systems = {r.system for r in reqs}
    assert len(systems) == 3 and all(len(s.split()) == 40 for s in systems)
    assert {r.prefix_id for r in reqs} == {0, 1, 2}
    assert all(r.input_len == 50 and len(r.prompt.split()) == 10 for r in reqs)
    assert len({r.prompt for r in reqs}) == 60  # suffixes differ


def test_bad_dataset_configs():
    with pytest.raises(ValueError, match="sharegpt"):
        DatasetConfig("sharegpt")
    with pytest.raises(ValueError, match="kind"):
        DatasetConfig("random")
    with pytest.raises(ValueError):
        DatasetConfig(input_len="uniform:1")
