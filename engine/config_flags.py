"""Command-line flags generated from a config dataclass: one flag per field, its type, default and help read from
the field (the string under it), so a command's flags and its config's defaults have one source. ``FlagOverride``
renames or re-parses a flag; ``ConfigFlags.values`` reads the flags back as field values. ``EngineConfig``'s flags
(``engine.engine_flags``) and ``GatewayConfig``'s (``gateway.cli.gateway_flags``) are made so.

No torch here: every ``moegate`` command builds its parser with these.
"""

import argparse
import ast
import dataclasses
import functools
import inspect
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping


def int_list(text: str) -> tuple[int, ...]:
    """A tuple field's flag value: comma-separated whole numbers."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes comma-separated whole numbers, got {text!r}") from None


FIELD_DEFAULT = object()  # FlagOverride.default: the field's own


@dataclasses.dataclass(frozen=True, slots=True)
class FlagOverride:
    """What differs from the generated flag: its name (``--field-name`` otherwise; for a bool field that is on by
    default, the name that turns it off), the parser of its value, its metavar, its help's last words, the flag's
    default where it is not the field's (a field without a default of its own; a command's default for a library
    setting), what the default is, said after it, and how the flag's value maps onto the field's (``to_field``;
    ``to_flag`` the other way, for the field's default: days for a field in seconds, say)."""

    flag: str | None = None
    parse: Callable[[str], object] | None = None
    metavar: str | None = None
    help_suffix: str = ""
    default: object = FIELD_DEFAULT
    default_note: str = ""
    to_field: Callable[[object], object] | None = None
    to_flag: Callable[[object], object] | None = None


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under it in the source of ``cls`` or of the dataclass it
    extends), whitespace folded."""
    docs = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        tree = ast.parse(inspect.getsource(sys.modules[klass.__module__]))
        body = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == klass.__name__).body
        previous = None
        for node in body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                previous = node.target.id
            elif previous and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                    and isinstance(node.value.value, str):
                docs[previous] = " ".join(node.value.value.split())
                previous = None
            else:
                previous = None
    return docs


_CODE_POINTER = re.compile(r" ?\(``[\w.]+\.[\w.]+``\)")  # "(``engine.core.speculation``)": for readers of the code
_REFERENCE = re.compile(r"``([^`]+)``")


@dataclasses.dataclass(frozen=True)
class ConfigFlags:
    """How the fields of the config dataclass ``cls`` become flags: all but ``not_flags`` (what the commands set
    themselves), each as ``overrides`` says, ``choices`` the values a field may take."""

    cls: type
    overrides: Mapping[str, FlagOverride] = dataclasses.field(default_factory=dict)
    not_flags: tuple[str, ...] = ()
    choices: Mapping[str, tuple] = dataclasses.field(default_factory=dict)

    def flag_name(self, field: str) -> str:
        """The flag of a field."""
        override = self.overrides.get(field)
        if override is not None and override.flag:
            return override.flag
        return "--" + field.replace("_", "-")

    def fields(self, exclude: tuple[str, ...] = ()) -> list[dataclasses.Field]:
        """The fields that are flags (but ``exclude``)."""
        return [f for f in dataclasses.fields(self.cls) if f.name not in self.not_flags and f.name not in exclude]

    def add_flags(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                  exclude: tuple[str, ...] = ()) -> None:
        """One flag per field but ``not_flags`` and ``exclude``, into ``parser``."""
        docs = field_docs(self.cls)
        hints = typing.get_type_hints(self.cls)
        for field in self.fields(exclude):
            if field.name not in docs:
                raise TypeError(f"{self.cls.__name__}.{field.name} has no docstring: it is its flag's help")
            self._add_flag(parser, field, hints[field.name], docs[field.name])

    def values(self, args: argparse.Namespace) -> dict[str, object]:
        """The field values the flags in ``args`` give (each through its ``to_field``)."""
        out = {}
        for field in dataclasses.fields(self.cls):
            if hasattr(args, field.name):
                to_field = self.overrides.get(field.name, FlagOverride()).to_field
                value = getattr(args, field.name)
                out[field.name] = to_field(value) if to_field is not None else value
        return out

    def _add_flag(self, parser, field: dataclasses.Field, hint, doc: str) -> None:
        override = self.overrides.get(field.name, FlagOverride())
        default = _field_default(field) if override.default is FIELD_DEFAULT else override.default
        if override.to_flag is not None and override.default is FIELD_DEFAULT:
            default = override.to_flag(default)
        kind, optional = _base_type(hint)
        help_text = self._help(doc)
        flag = self.flag_name(field.name)
        common = dict(dest=field.name, help=f"{help_text} {override.help_suffix}".strip())
        if kind is bool:
            if optional:  # None: the program decides
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, **common)
            elif default:  # on by default: the flag turns it off
                parser.add_argument(flag, action="store_false", default=True, dest=field.name,
                                    help=f"do not {common['help']} (done by default)")
            else:
                parser.add_argument(flag, action="store_true", default=False, **common)
            return
        parse = override.parse or (int_list if kind is tuple else kind)
        if default is not None:
            shown = f"{default:g}" if isinstance(default, float) else default
            common["help"] = f"{help_text} (default {shown}{override.default_note}) {override.help_suffix}".strip()
        choices = self.choices.get(field.name)
        metavar = override.metavar or ("N,N,..." if kind is tuple else flag.lstrip("-").upper())
        parser.add_argument(flag, type=parse, default=default, choices=choices,
                            metavar=None if choices else metavar.replace("-", "_"), **common)

    def _help(self, doc: str) -> str:
        """A field's docstring as help: code pointers dropped, ``another_field`` shown as its flag (where it has
        one), % escaped for argparse."""
        names = {f.name for f in self.fields()}

        def flag(match: re.Match) -> str:
            return self.flag_name(match.group(1)) if match.group(1) in names else match.group(1)

        return _REFERENCE.sub(flag, _CODE_POINTER.sub("", doc)).replace("%", "%%")


def _field_default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _base_type(hint) -> tuple[type, bool]:
    """(the field's type without None, whether None is allowed): ``int | None`` -> (int, True)."""
    optional = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    if optional:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return (typing.get_origin(hint) or hint), optional
