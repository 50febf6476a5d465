"""``moegate serve``'s gateway flags, generated from ``GatewayConfig`` as the engine's are from ``EngineConfig``
(``engine.engine_flags``): one flag per field but ``NOT_FLAGS``, its type, default and help read from the field
(the string under it). ``OVERRIDES`` renames or re-parses a few; ``gateway_config`` reads the flags back."""

import argparse

from engine.config_flags import ConfigFlags, FlagOverride
from gateway.config import GatewayConfig
from gateway.cors import parse_origins
from gateway.remote_images import parse_domains
from gateway.tool_parsers import REASONING_PARSERS, TOOL_PARSERS
from tenants.db import DEFAULT_DATABASE_URL, ENV_VAR, database_url

DAY_S = 86400.0


def _parser_setting(value: str) -> str | None:
    """``--tool-call-parser`` / ``--reasoning-parser``: "none" turns the parser off."""
    return None if value == "none" else value


OVERRIDES: dict[str, FlagOverride] = {
    # None: the environment's database, else the embedded SQLite default.
    "database_url": FlagOverride(default=None, to_field=database_url,
                                 help_suffix=f"(default: ${ENV_VAR} or {DEFAULT_DATABASE_URL})"),
    "drain_timeout_s": FlagOverride(flag="--drain-timeout"),
    "keepalive_timeout_s": FlagOverride(flag="--keepalive-timeout"),
    "body_timeout_s": FlagOverride(flag="--body-timeout"),
    "engine_restart_backoff_s": FlagOverride(flag="--engine-restart-backoff", metavar="SECONDS"),
    "engine_restart_backoff_max_s": FlagOverride(flag="--engine-restart-backoff-max", metavar="SECONDS"),
    # The command line serves /metrics on its own listener unless told not to (a library user opts in).
    "metrics_port": FlagOverride(default=9400, default_note="; -1: none",
                                 to_field=lambda port: port if port >= 0 else None),
    "batch_lease_s": FlagOverride(flag="--batch-lease-seconds"),
    "responses_retention_s": FlagOverride(flag="--responses-retention-days", metavar="DAYS",
                                          to_flag=lambda seconds: seconds / DAY_S, to_field=lambda days: days * DAY_S),
    "tool_call_parser": FlagOverride(to_field=_parser_setting),
    "reasoning_parser": FlagOverride(to_field=_parser_setting),
    # Read as text and checked in gateway_config, so a bad origin is serve's one line naming the flag.
    "allowed_origins": FlagOverride(parse=str, metavar="ORIGINS", default=None, to_field=parse_origins),
    "allowed_media_domains": FlagOverride(parse=str, metavar="HOSTS", default=None, to_field=parse_domains),
    "media_fetch_timeout_s": FlagOverride(flag="--media-fetch-timeout", metavar="SECONDS"),
}
# Settings with no flag: the tokens come from the environment (MOEGATE_METRICS_TOKEN, MOEGATE_ADMIN_TOKEN), never
# the process list; the others are limits and intervals set in code (and shorter in tests).
NOT_FLAGS = ("max_request_bytes", "auth_cache_ttl_s", "policy_cache_ttl_s", "metrics_token", "admin_token",
             "max_inflight_by_priority", "batch_max_file_bytes", "batch_max_lines", "batch_completion_window_s",
             "batch_poll_s")
CHOICES = {"tool_call_parser": ("auto", "none", *TOOL_PARSERS),
           "reasoning_parser": ("auto", "none", *REASONING_PARSERS)}

GATEWAY_FLAGS = ConfigFlags(GatewayConfig, OVERRIDES, NOT_FLAGS, CHOICES)


def add_gateway_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ``GatewayConfig`` field but ``NOT_FLAGS``, into ``parser``."""
    GATEWAY_FLAGS.add_flags(parser)


def gateway_config(args: argparse.Namespace, **fields) -> GatewayConfig:
    """The ``GatewayConfig`` of ``add_gateway_flags``' flags in ``args`` (and ``fields`` over them). ValueError for
    a bad value."""
    return GatewayConfig(**{**GATEWAY_FLAGS.values(args), **fields})
