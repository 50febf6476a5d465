"""The engine flags of `moegate serve`, `moegate engine` and `moegate run-batch` come from EngineConfig: every field
is a flag of each, with EngineConfig's default (shown once in --help), and a value given reaches the config."""

import dataclasses
import random
import re

import pytest

from engine.core.config import CHOICES, EngineConfig
from engine.engine_flags import NOT_FLAGS, REPLICA_FIELDS, engine_config, flag_name
from engine.loading.demo_model import DEFAULT_DEMO_MODEL_DIR
from gateway.cli import build_parser, main

COMMANDS = {"serve": ["serve"], "engine": ["engine", "--listen", "127.0.0.1:0"],
            "run-batch": ["run-batch", "-i", "in.jsonl", "-o", "out.jsonl"]}


def _fields(command: str) -> list[dataclasses.Field]:
    held_back = NOT_FLAGS + (() if command == "engine" else REPLICA_FIELDS)
    return [f for f in dataclasses.fields(EngineConfig) if f.name not in held_back]


def _default(field: dataclasses.Field):
    return DEFAULT_DEMO_MODEL_DIR if field.default is dataclasses.MISSING else field.default


@pytest.mark.parametrize("command", COMMANDS)
def test_every_field_is_a_flag_with_engine_configs_default(command):
    args = build_parser().parse_args(COMMANDS[command])
    for field in _fields(command):
        assert getattr(args, field.name) == _default(field), (command, field.name)
    config = engine_config(args)
    reference = EngineConfig(model=DEFAULT_DEMO_MODEL_DIR)
    assert config == reference
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.kv_cache_memory_gb) == (256, 2048, 2.0)


def _option_help(help_text: str) -> dict[str, str]:
    """--flag -> its help, from argparse's --help layout (options start at two spaces, help runs on)."""
    out, current = {}, None
    for line in help_text.splitlines():
        found = re.match(r"  (--[a-z-]+)", line)
        if found:
            current = found.group(1)
            out[current] = line
        elif current and line.startswith("   "):
            out[current] += " " + line.strip()
        else:
            current = None
    return {flag: " ".join(text.split()) for flag, text in out.items()}


def test_serve_help_shows_each_default_once_and_equal_to_engine_configs(capsys):
    with pytest.raises(SystemExit) as ended:
        main(["serve", "--help"])
    assert ended.value.code == 0
    helps = _option_help(capsys.readouterr().out)
    for field in _fields("serve"):
        text = helps[flag_name(field.name)]
        default = _default(field)
        shown = re.findall(r"\(default ([^):]+)", text)
        if default is None or isinstance(default, bool):
            assert text.count("(default") <= 1, (field.name, text)  # None: what the engine does, said once
            continue
        assert len(shown) == 1 and text.count("default") == 1, (field.name, text)
        value = shown[0].strip()
        assert (type(default)(value) if not isinstance(default, str) else value) == default, (field.name, value)
    # The flags serve kept under their names, with their special parsing.
    for flag in ("--no-prefix-caching", "--background-window-seconds", "--distributed-timeout",
                 "--cuda-graph-token-sizes", "--overlap-scheduling"):
        assert flag in helps, flag


def test_given_values_reach_the_engine_config():
    rng = random.Random()
    seqs, tokens = rng.randint(1, 512), rng.randint(512, 8192)
    values = {"--max-num-seqs": seqs, "--max-num-batched-tokens": tokens, "--max-model-len": rng.randint(2, 9999),
              "--kv-cache-memory-gb": round(rng.uniform(0.01, 8), 3), "--num-kv-blocks": rng.randint(1, 999),
              "--block-size": 2 ** rng.randint(0, 6), "--background-window-seconds": round(rng.uniform(0, 60), 3),
              "--distributed-timeout": round(rng.uniform(0.5, 99), 3), "--seed": rng.randint(0, 2**31),
              "--cuda-graph-batch-sizes": sorted(rng.sample(range(1, 64), 3))}
    # role: a prefill or decode engine needs the prefix cache, which this test turns off (checked below).
    choices = {name: rng.choice(options) for name, options in CHOICES.items() if name not in ("speculative", "role")}
    flags = [str(part) for flag, value in values.items()
             for part in (flag, ",".join(map(str, value)) if isinstance(value, list) else value)]
    flags += [part for name, value in choices.items() for part in (flag_name(name), value)]
    for command, head in COMMANDS.items():
        args = build_parser().parse_args([*head, *flags, "--enforce-eager", "--no-prefix-caching"])
        config = engine_config(args)
        got = {flag: getattr(config, name) for name in (f.name for f in _fields(command))
               if (flag := flag_name(name)) in values}
        assert got == {flag: tuple(v) if isinstance(v, list) else v for flag, v in values.items()}, command
        assert {name: getattr(config, name) for name in choices} == choices
        assert config.enforce_eager and not config.enable_prefix_caching
        role = rng.choice(["prefill", "decode"])
        assert engine_config(build_parser().parse_args([*head, "--role", role])).role == role
        with pytest.raises(ValueError, match="enable_prefix_caching"):
            engine_config(build_parser().parse_args([*head, "--role", role, "--no-prefix-caching"]))


def test_a_bad_value_is_one_line_naming_the_flag(capsys):
    for flags, named in ((["--max-num-seqs", "lots"], "--max-num-seqs"), (["--kernels", "cuda"], "--kernels"),
                         (["--cuda-graph-batch-sizes", "1,x"], "--cuda-graph-batch-sizes")):
        for head in COMMANDS.values():
            with pytest.raises(SystemExit) as ended:
                build_parser().parse_args([*head, *flags])
            err = capsys.readouterr().err
            assert ended.value.code == 2 and err.count("\n") == 1 and named in err, err
