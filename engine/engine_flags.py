"""The engine's command-line flags, generated from ``EngineConfig``: one flag per field, its type, default and
help read from the field (the string under it), so ``moegate serve``, ``moegate engine`` and ``moegate run-batch``
offer the same flags with ``EngineConfig``'s defaults. ``OVERRIDES`` renames or re-parses a few flags (and
``NOT_FLAGS`` holds back what the commands set themselves); ``engine_config`` reads the flags back.

No torch here: every ``moegate`` command builds its parser with these.
"""

import argparse

from engine.config_flags import ConfigFlags, FlagOverride, int_list
from engine.core.config import CHOICES, EngineConfig
from engine.loading.demo_model import DEFAULT_DEMO_MODEL_DIR


def token_sizes(text: str) -> tuple[int, ...]:
    """``--cuda-graph-token-sizes``: "16,32,64" or "none" (an empty tuple: piecewise graphs off)."""
    if text.strip().lower() == "none":
        return ()
    try:
        return int_list(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"--cuda-graph-token-sizes takes comma-separated token counts or none, "
                                         f"got {text!r}") from None


def seconds_or_none(text: str) -> float | None:
    """``--starvation-bound-seconds``: a number of seconds > 0, or none (no bound)."""
    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes seconds or none, got {text!r}") from None


OVERRIDES: dict[str, FlagOverride] = {
    "model": FlagOverride(default=DEFAULT_DEMO_MODEL_DIR, default_note=": the random-weight demo model, written there "
                                                                       "on first use"),
    "enable_prefix_caching": FlagOverride(flag="--no-prefix-caching"),
    "background_window_s": FlagOverride(flag="--background-window-seconds"),
    "starvation_bound_s": FlagOverride(flag="--starvation-bound-seconds", parse=seconds_or_none,
                                       metavar="SECONDS|none"),
    "distributed_timeout_s": FlagOverride(flag="--distributed-timeout"),
    "cuda_graph_token_sizes": FlagOverride(parse=token_sizes, metavar="N,N,...|none"),
    "distributed_init_method": FlagOverride(metavar="tcp://HOST:PORT"),
    "random_weights": FlagOverride(metavar="SPEC", help_suffix="(--model then only supplies the tokenizer)"),
    "speculative_model": FlagOverride(metavar="PATH"),
    "kv_transfer_address": FlagOverride(metavar="HOST[:PORT]"),
    "kv_transfer_timeout_s": FlagOverride(flag="--kv-transfer-timeout", metavar="SECONDS"),
    "local_prefill_tokens": FlagOverride(metavar="N"),
    "prefill_queue_tokens": FlagOverride(metavar="N"),
}
# Fields the commands fill in themselves: with --random-weights, --model names the tokenizer; moegate serve reads
# the deployment from its database (and hands it to its remote engines).
NOT_FLAGS = ("tokenizer", "deployment_id")
# A group of replicas dividing the experts: `moegate engine` takes these as they are; `moegate serve` lays its
# local replicas out itself (its own --data-parallel-size) and `moegate run-batch` runs one engine.
REPLICA_FIELDS = ("data_parallel_size", "data_parallel_rank")


ENGINE_FLAGS = ConfigFlags(EngineConfig, OVERRIDES, NOT_FLAGS, CHOICES)


def flag_name(field: str) -> str:
    """The flag of an ``EngineConfig`` field."""
    return ENGINE_FLAGS.flag_name(field)


# The last line of every engine command's --help.
FEATURES_POINTER = ("Which settings need or exclude others, and the message each such refusal gives: "
                    "`moegate features` (also in docs/configuration.md).")


def add_engine_flags(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """One flag per ``EngineConfig`` field but ``NOT_FLAGS`` and ``exclude``, into ``parser``; its help ends
    with where to read which settings go together."""
    ENGINE_FLAGS.add_flags(parser, exclude)
    parser.epilog = ((parser.epilog + " ") if parser.epilog else "") + FEATURES_POINTER


def engine_config(args: argparse.Namespace, **fields) -> EngineConfig:
    """The ``EngineConfig`` of ``add_engine_flags``' flags in ``args`` (and ``fields`` over them); with
    ``--random-weights`` the model is that spec's name and ``--model`` its tokenizer. ValueError for a bad value."""
    given = ENGINE_FLAGS.values(args)
    given.update(fields)
    if given.get("random_weights") is not None:
        from engine.loading.random_weights import served_name

        given["tokenizer"], given["model"] = given["model"], served_name(given["random_weights"])
    return EngineConfig(**given)
