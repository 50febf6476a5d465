"""The engine's command-line flags, generated from ``EngineConfig``: one flag per field, its type, default and
help read from the field (the string under it), so ``moegate serve``, ``moegate engine`` and ``moegate run-batch``
offer the same flags with ``EngineConfig``'s defaults. ``OVERRIDES`` renames or re-parses a few flags (and
``NOT_FLAGS`` holds back what the commands set themselves); ``engine_config`` reads the flags back.

No torch here: every ``moegate`` command builds its parser with these.
"""

import argparse
import ast
import dataclasses
import functools
import inspect
import re
import types
import typing
from collections.abc import Callable

from engine.core import config as config_module
from engine.core.config import CHOICES, EngineConfig
from engine.loading.demo_model import DEFAULT_DEMO_MODEL_DIR


def token_sizes(text: str) -> tuple[int, ...]:
    """``--cuda-graph-token-sizes``: "16,32,64" or "none" (an empty tuple: piecewise graphs off)."""
    if text.strip().lower() == "none":
        return ()
    try:
        return _int_list(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"--cuda-graph-token-sizes takes comma-separated token counts or none, "
                                         f"got {text!r}") from None


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes comma-separated whole numbers, got {text!r}") from None


@dataclasses.dataclass(frozen=True, slots=True)
class FlagOverride:
    """What differs from the generated flag: its name (``--field-name`` otherwise; for a bool field that is on by
    default, the name that turns it off), the parser of its value, its metavar, its help's last words, and for a
    field without a default of its own, the flag's."""

    flag: str | None = None
    parse: Callable[[str], object] | None = None
    metavar: str | None = None
    help_suffix: str = ""
    default: object = None  # only for a field without a default of its own
    default_note: str = ""  # what the default is, after it


OVERRIDES: dict[str, FlagOverride] = {
    "model": FlagOverride(default=DEFAULT_DEMO_MODEL_DIR, default_note=": the random-weight demo model, written there "
                                                                       "on first use"),
    "enable_prefix_caching": FlagOverride(flag="--no-prefix-caching"),
    "background_window_s": FlagOverride(flag="--background-window-seconds"),
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


def flag_name(field: str) -> str:
    """The flag of an ``EngineConfig`` field."""
    override = OVERRIDES.get(field)
    if override is not None and override.flag:
        return override.flag
    return "--" + field.replace("_", "-")


@functools.cache
def field_docs() -> dict[str, str]:
    """Each ``EngineConfig`` field's docstring (the string literal under it), whitespace folded."""
    tree = ast.parse(inspect.getsource(config_module))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == EngineConfig.__name__)
    docs, previous = {}, None
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            previous = node.target.id
        elif previous and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            docs[previous] = " ".join(node.value.value.split())
            previous = None
        else:
            previous = None
    return docs


def add_engine_flags(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """One flag per ``EngineConfig`` field but ``NOT_FLAGS`` and ``exclude``, into ``parser``."""
    docs = field_docs()
    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        if field.name in NOT_FLAGS or field.name in exclude:
            continue
        if field.name not in docs:
            raise TypeError(f"EngineConfig.{field.name} has no docstring: it is its flag's help")
        _add_flag(parser, field, hints[field.name], docs[field.name])


def _add_flag(parser: argparse.ArgumentParser, field: dataclasses.Field, hint, doc: str) -> None:
    override = OVERRIDES.get(field.name, FlagOverride())
    default = override.default if field.default is dataclasses.MISSING else field.default
    kind, optional = _base_type(hint)
    help_text = _help(doc)
    common = dict(dest=field.name, help=f"{help_text} {override.help_suffix}".strip())
    if kind is bool:
        if optional:  # None: the engine decides
            parser.add_argument(flag_name(field.name), action=argparse.BooleanOptionalAction, default=default,
                                **common)
        elif default:  # on by default: the flag turns it off
            parser.add_argument(flag_name(field.name), action="store_false", default=True, dest=field.name,
                                help=f"do not {common['help']} (done by default)")
        else:
            parser.add_argument(flag_name(field.name), action="store_true", default=False, **common)
        return
    parse = override.parse or (_int_list if kind is tuple else kind)
    if default is not None:
        shown = f"{default:g}" if isinstance(default, float) else default
        common["help"] = f"{help_text} (default {shown}{override.default_note}) {override.help_suffix}".strip()
    metavar = override.metavar or ("N,N,..." if kind is tuple else flag_name(field.name).lstrip("-").upper())
    parser.add_argument(flag_name(field.name), type=parse, default=default, choices=CHOICES.get(field.name),
                        metavar=None if field.name in CHOICES else metavar.replace("-", "_"), **common)


def _base_type(hint) -> tuple[type, bool]:
    """(the field's type without None, whether None is allowed): ``int | None`` -> (int, True)."""
    optional = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    if optional:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return (typing.get_origin(hint) or hint), optional


_CODE_POINTER = re.compile(r" ?\(``[\w.]+\.[\w.]+``\)")  # "(``engine.core.speculation``)": for readers of the code
_REFERENCE = re.compile(r"``([^`]+)``")


def _help(doc: str) -> str:
    """A field's docstring as help: code pointers dropped, ``another_field`` shown as its flag, % escaped for
    argparse."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}

    def flag(match: re.Match) -> str:
        return flag_name(match.group(1)) if match.group(1) in names else match.group(1)

    return _REFERENCE.sub(flag, _CODE_POINTER.sub("", doc)).replace("%", "%%")


def engine_config(args: argparse.Namespace, **fields) -> EngineConfig:
    """The ``EngineConfig`` of ``add_engine_flags``' flags in ``args`` (and ``fields`` over them); with
    ``--random-weights`` the model is that spec's name and ``--model`` its tokenizer. ValueError for a bad value."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    given.update(fields)
    if given.get("random_weights") is not None:
        from engine.loading.random_weights import served_name

        given["tokenizer"], given["model"] = given["model"], served_name(given["random_weights"])
    return EngineConfig(**given)
