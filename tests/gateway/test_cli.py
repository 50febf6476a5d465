"""The moegate command line: bad input gets exit code 2 and one line on stderr.

The console script itself (``python -m gateway.cli``: a fresh interpreter, whose imports print nothing, and the
exit code ``main`` returns or argparse's exit) runs in a process of its own for a bad value (``main``'s
ValueError) and for bad usage (argparse); every other case calls ``main`` in this process, its return value the
exit code: an interpreter a case costs 2-5 s of CPU importing torch and the gateway."""

import subprocess
import sys

import pytest

from gateway.cli import main


def moegate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True, timeout=120)


def one_line(err: str) -> bool:
    return len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_serve_with_missing_model_is_one_line_exit_2(tmp_path):
    r = moegate("serve", "--model", str(tmp_path / "nope"))
    assert r.returncode == 2
    assert one_line(r.stderr) and "not a directory" in r.stderr


def test_serve_with_unsupported_architecture(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    assert main(["serve", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unsupported architecture" in err and one_line(err), err


def test_loadgen_rejects_unknown_system(capsys):
    assert main(["loadgen", "offline", "--systems", "moegate,vllm"]) == 2
    err = capsys.readouterr().err
    assert "unknown systems" in err and one_line(err), err


def test_usage_errors_exit_2(capsys):
    r = moegate("serve", "--port", "not-a-port")
    assert r.returncode == 2 and "--port" in r.stderr and one_line(r.stderr)
    with pytest.raises(SystemExit) as exited:  # argparse's exit, as the console script's above
        main(["loadgen", "offline", "--num-requests", "x"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and one_line(err), err


def test_serve_checks_weights_and_upgrades_embedded_sqlite(tmp_path, capsys):
    """Missing weights are bad input (exit 2); an embedded SQLite schema is brought to head on the way."""
    from tenants.migrate import current_revision

    db = f"sqlite:///{tmp_path / 'policy.db'}"
    cfg = tmp_path / "m"
    cfg.mkdir()
    (cfg / "config.json").write_text('{"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}')
    assert main(["serve", "--model", str(cfg), "--database-url", db]) == 2
    err = capsys.readouterr().err
    assert "no *.safetensors" in err and one_line(err), err
    assert current_revision(db) is None  # checked before touching the database


def test_serve_rejects_bad_engine_settings_before_touching_anything(tmp_path, capsys):
    import random

    db = f"sqlite:///{tmp_path / 'policy.db'}"
    rng = random.Random()
    bad = [("--cpu-threads", str(-rng.randint(0, 8)), "cpu_threads"),
           ("--background-token-budget", str(-rng.randint(0, 100)), "background_token_budget"),
           ("--background-window-seconds", str(-rng.uniform(0.001, 10)), "background_window_s"),
           ("--gpu-memory-utilization", rng.choice(["0", str(rng.uniform(1.01, 3))]), "gpu_memory_utilization")]
    for flag, value, name in bad:
        # The model directory does not exist either: the setting is reported first, before any file is read.
        code = main(["serve", "--model", str(tmp_path / "absent"), "--database-url", db, flag, value])
        err = capsys.readouterr().err
        assert code == 2, (flag, value, err)
        assert one_line(err) and name in err, err
    assert not (tmp_path / "policy.db").exists()  # the database was not opened


def test_serve_rejects_bad_engine_restart_backoff_naming_the_flag(tmp_path, capsys):
    db = f"sqlite:///{tmp_path / 'policy.db'}"
    for flags in (["--engine-restart-backoff", "0"], ["--engine-restart-backoff", "-2"],
                  ["--engine-restart-backoff", "30", "--engine-restart-backoff-max", "10"]):
        # In-process (main's return value is the exit code): the check comes before anything starts.
        assert main(["serve", "--model", str(tmp_path / "absent"), "--database-url", db, *flags]) == 2, flags
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "--engine-restart-backoff" in err, err
    assert not (tmp_path / "policy.db").exists()


def test_serve_engine_settings_reach_the_engine_config():
    import random

    from engine.core.config import EngineConfig
    from engine.engine_flags import engine_config
    from gateway.cli import build_parser

    rng = random.Random()
    budget, window, threads = rng.randint(1, 4096), round(rng.uniform(0, 60), 3), rng.randint(1, 64)
    share, seed = round(rng.uniform(0.05, 1.0), 3), rng.randint(1, 2**31)
    args = build_parser().parse_args(["serve", "--model", "m", "--background-token-budget", str(budget),
                                      "--background-window-seconds", str(window), "--cpu-threads", str(threads),
                                      "--gpu-memory-utilization", str(share), "--seed", str(seed)])
    got = engine_config(args)
    assert (got.background_token_budget, got.background_window_s, got.cpu_threads, got.gpu_memory_utilization,
            got.seed) == (budget, window, threads, share, seed)
    engine_args = build_parser().parse_args(["engine", "--listen", "127.0.0.1:1", "--model", "m", "--seed", str(seed)])
    assert engine_config(engine_args).seed == seed
    defaults = engine_config(build_parser().parse_args(["serve", "--model", "m"]))
    reference = EngineConfig(model="m")
    assert (defaults.background_token_budget, defaults.background_window_s, defaults.cpu_threads,
            defaults.gpu_memory_utilization, defaults.seed) == (
        reference.background_token_budget, reference.background_window_s, None, reference.gpu_memory_utilization,
        reference.seed)
    assert defaults.overlap_scheduling is reference.overlap_scheduling is None  # the device decides
    for flag, value in (("--overlap-scheduling", True), ("--no-overlap-scheduling", False)):
        assert engine_config(build_parser().parse_args(["serve", "--model", "m", flag])).overlap_scheduling is value


def test_speculative_settings_reach_the_engine_config():
    import random

    from engine.core.config import EngineConfig
    from engine.engine_flags import engine_config
    from gateway.cli import build_parser

    rng = random.Random()
    k, batch, accept = rng.randint(1, 16), rng.randint(1, 256), round(rng.uniform(0, 1), 3)
    args = build_parser().parse_args(["serve", "--model", "m", "--speculative", "ngram", "--num-speculative-tokens",
                                      str(k), "--speculative-max-batch", str(batch),
                                      "--speculative-min-acceptance", str(accept)])
    got = engine_config(args)
    assert (got.speculative, got.num_speculative_tokens, got.speculative_max_batch,
            got.speculative_min_acceptance) == ("ngram", k, batch, accept)
    defaults = engine_config(build_parser().parse_args(["serve", "--model", "m"]))
    reference = EngineConfig(model="m")
    assert defaults.speculative is None and defaults.speculative_model is None
    draft = engine_config(build_parser().parse_args(["serve", "--model", "m", "--speculative", "draft",
                                                           "--speculative-model", "small"]))
    assert (draft.speculative, draft.speculative_model) == ("draft", "small")
    assert (defaults.num_speculative_tokens, defaults.speculative_max_batch, defaults.speculative_min_acceptance) == (
        reference.num_speculative_tokens, reference.speculative_max_batch, reference.speculative_min_acceptance)


def test_serve_splits_random_weights_over_ranks_and_refuses_what_does_not_divide(tmp_path, capsys):
    """--random-weights with --tensor-parallel-size 2 (and the experts divided over 2 x 2 ranks) passes the
    command line's split check; 3 ranks for 4 heads is bad input (exit 2, one line), found before the database."""
    from engine.engine_flags import engine_config
    from engine.loading.model_check import check_model
    from gateway.cli import build_parser

    spec = ("qwen3-30b-a3b:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
            "head_dim=16,vocab_size=512,num_experts=8,moe_intermediate_size=32,intermediate_size=64,bos_token_id=null,"
            "eos_token_id=511")
    for split in (["--tensor-parallel-size", "2"],
                  ["--tensor-parallel-size", "2", "--enable-expert-parallel", "--data-parallel-size", "2"]):
        args = build_parser().parse_args(["serve", "--model", str(tmp_path), "--random-weights", spec, *split])
        config = engine_config(args)
        assert config.random_weights == spec and config.tensor_parallel_size == 2
        check_model(config)  # no ValueError
    db = f"sqlite:///{tmp_path / 'policy.db'}"
    assert main(["serve", "--model", str(tmp_path), "--random-weights", spec, "--tensor-parallel-size", "3",
                 "--database-url", db]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "divisible" in err, err
    assert not (tmp_path / "policy.db").exists()


def test_a_random_model_smaller_than_its_tokenizer_is_bad_input(tmp_path, capsys):
    """The demo model's tokenizer lent to a random model with fewer token rows: exit 2 with one line naming the
    size to give, before anything is written or started (before, exit 1 after the model was built)."""
    import random

    from engine.loading.demo_model import write_demo_model
    from engine.text.tokenizer import load_tokenizer

    model = str(tmp_path / "demo")
    write_demo_model(model, seed=random.randrange(100))
    tokens = len(load_tokenizer(model))
    spec = ("qwen3-30b-a3b:num_hidden_layers=1,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,head_dim=16,"
            "num_experts=4,moe_intermediate_size=32,intermediate_size=64,bos_token_id=null,eos_token_id=1,"
            f"vocab_size={random.randrange(64, tokens)}")
    db = f"sqlite:///{tmp_path / 'policy.db'}"
    assert main(["serve", "--model", model, "--random-weights", spec, "--database-url", db]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"vocab_size={tokens}" in err, err
    assert not (tmp_path / "policy.db").exists()


def test_serve_refuses_a_setting_a_hybrid_model_does_not_support_yet(tmp_path, capsys):
    """A hybrid linear-attention checkpoint with --speculative (or --pipeline-parallel-size 2): exit 2, one line naming
    the flag, before the database is written or any process starts (before, the engine process failed: exit 1
    after the default tenant was created)."""
    from tests.hf_models import make_hf_model

    make_hf_model("qwen3_next", str(tmp_path / "hybrid"), seed=0)
    capsys.readouterr()  # the checkpoint writer's progress bar
    db = f"sqlite:///{tmp_path / 'policy.db'}"
    for flags, named in ((["--speculative", "ngram"], "--speculative"), (["--pipeline-parallel-size", "2"],
                                                                           "--pipeline-parallel-size")):
        assert main(["serve", "--model", str(tmp_path / "hybrid"), "--database-url", db, *flags]) == 2, flags
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and named in err and "hybrid linear-attention" in err, err
    assert not (tmp_path / "policy.db").exists()
