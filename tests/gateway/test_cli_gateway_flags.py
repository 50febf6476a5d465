"""`moegate serve`'s gateway flags come from GatewayConfig, as the engine's come from EngineConfig: every field but
NOT_FLAGS is a flag with GatewayConfig's default (shown once in --help), a value given reaches the config, and a
field added to the config is a flag with nothing else written."""

import argparse
import dataclasses
import random
import re

import pytest

from engine.config_flags import ConfigFlags
from gateway.cli import build_parser, main
from gateway.cli.gateway_flags import CHOICES, GATEWAY_FLAGS, NOT_FLAGS, OVERRIDES, gateway_config
from gateway.config import GatewayConfig
from tenants.db import DEFAULT_DATABASE_URL, ENV_VAR
from tests.gateway.test_cli_engine_flags import _option_help

# What the command line sets differently from a library user's GatewayConfig(): a /metrics listener.
COMMAND_LINE = {"metrics_port": 9400}


@pytest.fixture(autouse=True)
def _no_database_from_the_environment(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def test_every_field_is_a_serve_flag_with_gateway_configs_default():
    flags = [f.name for f in dataclasses.fields(GatewayConfig) if f.name not in NOT_FLAGS]
    assert len(flags) >= 15, flags
    args = build_parser().parse_args(["serve"])
    assert all(hasattr(args, name) for name in flags)
    assert gateway_config(args) == GatewayConfig(**COMMAND_LINE)
    assert gateway_config(args).database_url == DEFAULT_DATABASE_URL == GatewayConfig().database_url


def test_serve_help_shows_each_gateway_default_once_and_equal_to_gateway_configs(capsys):
    with pytest.raises(SystemExit) as ended:
        main(["serve", "--help"])
    assert ended.value.code == 0
    helps = _option_help(capsys.readouterr().out)
    reference = GatewayConfig(**COMMAND_LINE)
    for field in GATEWAY_FLAGS.fields():
        text = helps[GATEWAY_FLAGS.flag_name(field.name)]
        default = getattr(reference, field.name)
        shown = re.findall(r"\(default ([^);]+)", text)
        if default in (None, ()) or default is False or field.name == "database_url":  # False: a switch
            assert "(default " not in text, (field.name, text)  # what the program does instead, said in words
            continue
        assert len(shown) == 1 and text.count("(default") == 1, (field.name, text)
        override = OVERRIDES.get(field.name)
        value = type(default)(shown[0].strip())
        if override is not None and override.to_field is not None:
            value = override.to_field(value)
        assert value == default, (field.name, shown[0])
    # The flags kept their names.
    for flag in ("--drain-timeout", "--keepalive-timeout", "--body-timeout", "--batch-lease-seconds",
                 "--responses-retention-days", "--engine-restart-backoff-max", "--metrics-port", "--database-url"):
        assert flag in helps, flag


def test_given_values_reach_the_gateway_config(tmp_path):
    rng = random.Random()
    days = round(rng.uniform(0.01, 90), 3)
    backoff = round(rng.uniform(0.1, 10), 3)
    values = {"--host": f"127.0.0.{rng.randint(2, 250)}", "--port": rng.randint(1024, 65535),
              "--served-model-name": f"m{rng.randint(0, 999)}", "--database-url": f"sqlite:///{tmp_path}/t.db",
              "--drain-timeout": round(rng.uniform(0, 60), 3), "--keepalive-timeout": round(rng.uniform(1, 60), 3),
              "--body-timeout": round(rng.uniform(1, 60), 3), "--max-connections": rng.randint(1, 9999),
              "--engine-restart-backoff": backoff, "--engine-restart-backoff-max": backoff * rng.randint(1, 9),
              "--metrics-host": "0.0.0.0", "--metrics-port": rng.randint(0, 65535),
              "--default-reservation-tokens": rng.randint(1, 4096), "--data-dir": str(tmp_path / "data"),
              "--batch-lease-seconds": round(rng.uniform(1, 600), 3), "--batch-max-inflight": rng.randint(1, 99),
              "--responses-retention-days": days,
              "--tool-call-parser": rng.choice(CHOICES["tool_call_parser"][2:]),
              "--reasoning-parser": rng.choice(CHOICES["reasoning_parser"][2:]),
              "--allowed-origins": f"https://{rng.randrange(10**6)}.example,http://127.0.0.1:{rng.randint(1, 65535)}",
              "--allowed-media-domains": f"img{rng.randrange(10**6)}.example.com,*.cdn.example.net",
              "--media-fetch-timeout": round(rng.uniform(0.1, 60), 3),
              "--max-images-per-request": rng.randint(0, 64), "--max-image-pixels": rng.randint(1, 2**26)}
    switches = ["--allow-private-media-addresses"]  # on by being given
    argv = ["serve"] + [str(x) for flag, value in values.items() for x in (flag, value)] + switches
    config = gateway_config(build_parser().parse_args(argv))
    fields = {GATEWAY_FLAGS.flag_name(f.name): f.name for f in GATEWAY_FLAGS.fields()}
    assert sorted(fields) == sorted([*values, *switches])  # every flag given once
    assert all(getattr(config, fields[flag]) is True for flag in switches)
    for flag, value in values.items():
        expected = value * 86400 if flag == "--responses-retention-days" else value
        if flag in ("--allowed-origins", "--allowed-media-domains"):
            expected = tuple(value.split(","))
        assert getattr(config, fields[flag]) == pytest.approx(expected) if isinstance(value, float) \
            else getattr(config, fields[flag]) == expected, flag
    off = gateway_config(build_parser().parse_args(["serve", "--metrics-port", "-1", "--tool-call-parser", "none",
                                                    "--reasoning-parser", "none"]))
    assert (off.metrics_port, off.tool_call_parser, off.reasoning_parser) == (None, None, None)


def test_the_database_url_from_the_environment_when_no_flag_says(monkeypatch, tmp_path):
    url = f"sqlite:///{tmp_path}/env.db"
    monkeypatch.setenv(ENV_VAR, url)
    assert gateway_config(build_parser().parse_args(["serve"])).database_url == url
    given = f"sqlite:///{tmp_path}/flag.db"
    assert gateway_config(build_parser().parse_args(["serve", "--database-url", given])).database_url == given


@dataclasses.dataclass
class _WithOneMoreField(GatewayConfig):
    welcome_banner: str = "hello there"
    """a line the server prints when it starts"""


@dataclasses.dataclass
class _WithAnUndocumentedField(GatewayConfig):
    welcome_banner: str = ""


def test_a_field_added_to_the_config_is_a_flag():
    flags = ConfigFlags(_WithOneMoreField, OVERRIDES, NOT_FLAGS, CHOICES)
    parser = argparse.ArgumentParser()
    flags.add_flags(parser)
    assert "a line the server prints when it starts (default hello there)" in " ".join(
        parser.format_help().split())
    banner = f"banner {random.randrange(10**6)}"
    assert flags.values(parser.parse_args(["--welcome-banner", banner]))["welcome_banner"] == banner
    assert flags.values(parser.parse_args([]))["welcome_banner"] == "hello there"
    with pytest.raises(TypeError, match="welcome_banner has no docstring"):
        ConfigFlags(_WithAnUndocumentedField, OVERRIDES, NOT_FLAGS, CHOICES).add_flags(argparse.ArgumentParser())
