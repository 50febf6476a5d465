"""``moegate admin ...`` and ``moegate db ...``: tables for people, ``--json`` for scripts.

Bad input (unknown tenant, negative quota, duplicate name, unreachable
database) exits 2 with one line on stderr; each command is one store call,
hence one transaction, so a refused command changes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from dataclasses import asdict, is_dataclass
from datetime import date, datetime, timedelta

from tenants.db import DEFAULT_DATABASE_URL, ENV_VAR, SchemaError, database_url
from tenants.models import utcnow

NONE_WORDS = ("none", "unlimited", "")
QUOTA_FLAGS = {
    "rpm": "requests_per_minute",
    "tpm": "tokens_per_minute",
    "max_concurrency": "max_concurrency",
    "max_tokens": "max_tokens_per_request",
    "daily_tokens": "daily_tokens",
    "monthly_tokens": "monthly_tokens",
    "max_batch_queue_tokens": "max_batch_queue_tokens",
    "max_stored_file_bytes": "max_stored_file_bytes",
    "stored_response_bytes": "stored_response_bytes",
    "max_images_per_request": "max_images_per_request",
    "max_image_pixels": "max_image_pixels",
}
QUOTA_HELP = {
    "max_images_per_request": "images one chat request may carry; only tightens the gateway's "
                              "--max-images-per-request (none: the gateway's)",
    "max_image_pixels": "decoded pixels (width x height) one image may have, 1 or more; only tightens the gateway's "
                        "--max-image-pixels (none: the gateway's)",
}


# The largest numbers the database's columns hold (on PostgreSQL and SQLite alike): quotas are 64-bit, priorities,
# objectives and key ids 32-bit. A larger number is refused here by its flag, not by the driver mid-transaction.
BIGINT_MAX = 2**63 - 1
INT_MAX = 2**31 - 1


class CliError(Exception):
    """A one-line message for stderr, exit status 2."""


def _at_most(value: int, most: int) -> int:
    if value > most:
        raise argparse.ArgumentTypeError(f"must be at most {most}, got {value}")
    return value


# Digits past which a whole number is past every bound here and is named by its length: Python refuses to convert
# more than 4300 (with a message about its own setting), and a line of thousands of digits is no message.
_LONG_NUMBER = 100


def _whole(text: str, least: int, most: int) -> int:
    """``int(text)`` (a ValueError for what is no integer, which the caller words), except that a number of more
    than ``_LONG_NUMBER`` digits is refused by the bound it is past, named by its length."""
    body = text.strip().replace("_", "")
    digits = body.lstrip("+-")
    if digits.isdecimal() and len(digits) > _LONG_NUMBER:  # any script's digits: int() reads them all
        if body.startswith("-"):
            raise argparse.ArgumentTypeError(f"must be >= {least}, got a negative number of {len(digits)} digits")
        raise argparse.ArgumentTypeError(f"must be at most {most}, got a number of {len(digits)} digits")
    return int(text)


def _limit(text: str, least: int = 0, why: str = "") -> int | None:
    """A count from ``least`` (``why`` says what a smaller one is instead), or None for 'none'."""
    if text.strip().lower() in NONE_WORDS:
        return None
    try:
        value = _whole(text, least, BIGINT_MAX)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {least} or 'none', got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least} or 'none', got {value}{why}")
    return _at_most(value, BIGINT_MAX)


def _pixels(text: str) -> int | None:
    """``--max-image-pixels``: 1 and up, as the gateway's own flag takes it (an image has at least one pixel)."""
    return _limit(text, 1, " (pixels of one decoded image); to refuse the tenant's images, set "
                           "--max-images-per-request 0")


def _discount(text: str) -> float | None:
    if text.strip().lower() in NONE_WORDS:
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value}")
    return value


# Quota flags with a bound of their own (the rest take any count from 0, or 'none').
QUOTA_TYPES = {"max_image_pixels": _pixels}


def _share(text: str) -> float | None:
    if text.strip().lower() in NONE_WORDS:
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number greater than 0 and at most 1, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be greater than 0 and at most 1, got {value}")
    return value


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):  # an infinite weight leaves the fair shares nothing to divide
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def _priority(text: str) -> int:
    try:
        value = _whole(text, 0, INT_MAX)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return _at_most(value, INT_MAX)


def _objective_ms(text: str) -> int | None:
    if text.strip().lower() in NONE_WORDS:
        return None
    try:
        value = _whole(text, 1, INT_MAX)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number of milliseconds or 'none', got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 or 'none', got {value}")
    return _at_most(value, INT_MAX)


def _day(text: str) -> date:
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a date YYYY-MM-DD, got {text!r}") from None


def _key_ref(text: str) -> int | str:
    """``admin key revoke``'s key: an id (ASCII digits, within the id column's range: a larger number is no key's,
    refused by its bound), else a prefix."""
    if not (text.isascii() and text.isdigit()):
        return text
    if len(text) <= len(str(INT_MAX)) and int(text) <= INT_MAX:
        return int(text)
    shown = f"a number of {len(text)} digits" if len(text) > _LONG_NUMBER else text
    raise argparse.ArgumentTypeError(f"unknown api key: key ids are at most {INT_MAX}, got {shown}")


# -- output ------------------------------------------------------------------------------------------------


def _plain(value):
    if is_dataclass(value):
        value = asdict(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    return value


def _emit(args: argparse.Namespace, data, columns: list[str] | None = None, title: str | None = None) -> None:
    data = _plain(data)
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=False))
        return
    from rich.console import Console
    from rich.table import Table

    rows = data if isinstance(data, list) else [data]
    columns = columns or (list(rows[0]) if rows else [])
    table = Table(title=title)
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*["-" if r.get(c) is None else str(r.get(c)) for c in columns])
    Console(soft_wrap=True).print(table)


# -- commands ----------------------------------------------------------------------------------------------

TENANT_COLS = ["id", "name", "priority_class", "weight", "status", "created_at", "updated_at"]
KEY_COLS = ["id", "tenant", "label", "prefix", "created_at", "expires_at", "last_used_at", "revoked_at"]
CLASS_COLS = ["name", "priority", "default_weight", "preemptible", "may_preempt", "ttft_slo_ms", "itl_slo_ms",
              "slo_action"]


async def _admin(args: argparse.Namespace) -> int:
    from tenants.migrate import ensure_schema
    from tenants.store import TenantStore

    url = database_url(args.database_url)
    # Never auto-upgrade from an admin command: it would hide a forgotten `db upgrade` on a shared database.
    await asyncio.to_thread(ensure_schema, url, auto_upgrade_sqlite=False)
    store = TenantStore.open(url)
    try:
        return await args.admin_func(args, store)
    finally:
        await store.close()


async def _tenant_create(args, store) -> int:
    _emit(args, await store.create_tenant(args.name, args.priority_class, args.weight), TENANT_COLS)
    return 0


async def _tenant_list(args, store) -> int:
    _emit(args, await store.list_tenants(), TENANT_COLS, "tenants")
    return 0


async def _tenant_show(args, store) -> int:
    tenant = await store.get_tenant(args.name)
    quota = await store.get_quota(tenant.id)
    keys = await store.list_keys(tenant.id)
    if args.json:
        _emit(args, {"tenant": tenant, "quota": quota, "keys": keys})
    else:
        _emit(args, tenant, TENANT_COLS)
        _emit(args, quota, title="quota")
        _emit(args, keys, KEY_COLS, "keys")
    return 0


async def _tenant_update(args, store) -> int:
    info = await store.update_tenant(args.name, name=args.new_name, priority_class=args.priority_class,
                                     weight=args.weight)
    _emit(args, info, TENANT_COLS)
    return 0


async def _tenant_status(args, store) -> int:
    _emit(args, await store.set_tenant_status(args.name, args.active), TENANT_COLS)
    return 0


_DURATION_UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def _expiry(text: str | None):
    """``--expires-in 90d`` -> the naive UTC time it ends; ValueError (exit 2) for anything else."""
    if text is None:
        return None
    number, unit = text[:-1], text[-1:].lower()
    if unit not in _DURATION_UNITS or not (number.isascii() and number.isdigit()) or int(number) == 0:
        raise ValueError(f"--expires-in must be a positive whole number with a unit d, h, m or s (e.g. 90d), got {text!r}")
    try:
        return utcnow() + timedelta(seconds=int(number) * _DURATION_UNITS[unit])
    except OverflowError:  # past the year 9999
        raise ValueError(f"--expires-in {text!r} ends after the year 9999; give a shorter duration, or leave "
                         "--expires-in out for a key that does not expire") from None


async def _key_create(args, store) -> int:
    info, plaintext = await store.create_key(args.tenant, args.label, _expiry(args.expires_in))
    if args.json:
        print(json.dumps({**_plain(info), "key": plaintext}, indent=2))
    else:
        _emit(args, info, KEY_COLS)
        print(f"key: {plaintext}")
        print("store it now: it is shown only this once", file=sys.stderr)
    return 0


async def _key_list(args, store) -> int:
    _emit(args, await store.list_keys(args.tenant), KEY_COLS, "api keys")
    return 0


async def _key_revoke(args, store) -> int:
    _emit(args, await store.revoke_key(args.key), KEY_COLS)
    return 0


async def _quota_set(args, store) -> int:
    changes = {field: getattr(args, flag) for flag, field in QUOTA_FLAGS.items() if getattr(args, flag) is not _UNSET}
    if args.batch_discount is not _UNSET:
        changes["batch_discount"] = args.batch_discount
    if args.cache_share is not _UNSET:
        changes["cache_share"] = args.cache_share
    if not changes:
        raise CliError("nothing to set: give at least one of --rpm --tpm --max-concurrency --max-tokens "
                       "--daily-tokens --monthly-tokens --max-batch-queue-tokens --max-stored-file-bytes "
                       "--stored-response-bytes --max-images-per-request --max-image-pixels --batch-discount "
                       "--cache-share")
    _emit(args, await store.set_quota(args.tenant, **changes), title="quota")
    return 0


async def _quota_show(args, store) -> int:
    _emit(args, await store.get_quota(args.tenant), title="quota")
    return 0


async def _class_create(args, store) -> int:
    info = await store.create_class(args.name, args.priority, args.weight, args.preemptible, args.may_preempt)
    _emit(args, info, CLASS_COLS)
    return 0


async def _class_list(args, store) -> int:
    _emit(args, await store.list_classes(), CLASS_COLS, "priority classes")
    return 0


async def _class_update(args, store) -> int:
    info = await store.update_class(args.name, priority=args.priority, default_weight=args.weight,
                                    preemptible=args.preemptible, may_preempt=args.may_preempt)
    _emit(args, info, CLASS_COLS)
    return 0


async def _class_set(args, store) -> int:
    changes = {k: getattr(args, k) for k in ("ttft_slo_ms", "itl_slo_ms", "slo_action") if getattr(args, k) is not _UNSET}
    if not changes:
        raise CliError("nothing to set: give --ttft-slo-ms, --itl-slo-ms or --slo-action")
    _emit(args, await store.set_class_objectives(args.name, **changes), CLASS_COLS)
    return 0


ADAPTER_COLS = ["name", "owner", "granted", "rank", "target_modules", "base_model", "path", "created_at"]


async def _adapter_add(args, store) -> int:
    from tenants.adapters import AdapterStore

    if (args.tenant is None) == (not args.public):
        raise CliError("give the adapter an owner: --tenant NAME, or --public for every tenant")
    # The directory is checked here, before anything is written, and never reaches an engine if malformed.
    from engine.lora.peft_format import check_adapter_dir

    summary = check_adapter_dir(args.path)
    info = await AdapterStore(store).add(args.name, args.path, args.tenant, summary.rank, summary.target_modules,
                                         summary.base_model)
    _emit(args, _adapter_row(info), ADAPTER_COLS)
    return 0


def _adapter_row(info) -> dict:
    row = _plain(info)
    row["owner"] = info.owner or "(public)"
    row["granted"] = ",".join(info.granted) or None
    return row


async def _adapter_list(args, store) -> int:
    from tenants.adapters import AdapterStore

    _emit(args, [_adapter_row(a) for a in await AdapterStore(store).list(args.tenant)], ADAPTER_COLS, "adapters")
    return 0


async def _adapter_remove(args, store) -> int:
    from tenants.adapters import AdapterStore

    await AdapterStore(store).remove(args.name)
    _emit(args, {"removed": args.name})
    return 0


async def _adapter_grant(args, store) -> int:
    from tenants.adapters import AdapterStore

    adapters = AdapterStore(store)
    await (adapters.grant if args.grant else adapters.revoke)(args.name, args.tenant)
    _emit(args, {"adapter": args.name, "tenant": args.tenant, "granted": args.grant})
    return 0


async def _usage(args, store) -> int:
    rows = await store.usage_summary(args.tenant, args.since, args.until, args.by)
    cols = [args.by, "kind", "requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens", "billed_tokens",
            "goodput_tokens", "slo_requests", "slo_met", "attainment"]
    _emit(args, rows, cols, "usage")
    return 0


def _db(args: argparse.Namespace) -> int:
    from tenants import migrate

    url = database_url(args.database_url)
    if args.db_action == "upgrade":
        migrate.upgrade(url, args.revision)
    else:
        migrate.downgrade(url, args.revision)
    rev = migrate.current_revision(url)
    if args.json:
        print(json.dumps({"revision": rev}))
    else:
        print(f"database at revision {rev or 'base (empty)'}")
    return 0


# -- error handling ----------------------------------------------------------------------------------------


def _one_line(e: BaseException) -> str:
    from sqlalchemy.exc import DBAPIError

    if isinstance(e, DBAPIError):
        e = e.orig or e
    text = " ".join(str(e).split())
    return text[:300] or type(e).__name__


def _run(prog: str, fn) -> int:
    """Run a command; every expected failure becomes one line on stderr and exit 2."""
    from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError

    try:
        return fn()
    except (CliError, SchemaError, ValueError, ArgumentError, NoSuchModuleError) as e:
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
    except (DBAPIError, OSError) as e:
        print(f"{prog}: error: cannot use the database: {_one_line(e)}", file=sys.stderr)
    except Exception as e:  # driver errors (asyncpg's own classes) that SQLAlchemy did not wrap
        if type(e).__module__.split(".")[0] in ("asyncpg", "psycopg", "sqlite3", "alembic"):
            print(f"{prog}: error: cannot use the database: {_one_line(e)}", file=sys.stderr)
        else:
            raise
    return 2


def _admin_entry(args: argparse.Namespace) -> int:
    return _run("moegate admin", lambda: asyncio.run(_admin(args)))


def _db_entry(args: argparse.Namespace) -> int:
    return _run("moegate db", lambda: _db(args))


# -- parser ------------------------------------------------------------------------------------------------

_UNSET = object()


class _OneLineParser(argparse.ArgumentParser):
    """Bad usage is one line on stderr and exit 2 (argparse would also print the whole usage)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--database-url", default=None,
                        help=f"database URL (default: ${ENV_VAR} or {DEFAULT_DATABASE_URL})")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    return common


def _leaf(sub, name: str, func, common, help_: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, parents=[common], help=help_, description=help_)
    p.set_defaults(func=_admin_entry, admin_func=func)
    return p


def _bool_pair(p: argparse.ArgumentParser, name: str, default) -> None:
    dest = name.replace("-", "_")
    p.add_argument(f"--{name}", dest=dest, action="store_true", default=default)
    p.add_argument(f"--no-{name}", dest=dest, action="store_false")


def register(subparsers) -> None:
    """Add ``admin`` and ``db`` to the ``moegate`` subparsers; each leaf sets ``func(args) -> int``."""
    common = _common()
    admin = subparsers.add_parser("admin", help="manage tenants, keys, quotas, priority classes, LoRA adapters; "
                                                "show usage; scale a running gateway's replicas")
    groups = admin.add_subparsers(dest="admin_group", required=True, parser_class=_OneLineParser)
    _add_tenant(groups, common)
    _add_key(groups, common)
    _add_quota(groups, common)
    _add_class(groups, common)
    _add_adapter(groups, common)
    _add_usage(groups, common)
    _add_replicas(groups)
    _add_db(subparsers, common)


def _add_tenant(groups, common: argparse.ArgumentParser) -> None:
    """``admin tenant``: create, list, show, update, disable, enable."""
    tenant = groups.add_parser("tenant", help="tenants").add_subparsers(dest="action", required=True, parser_class=_OneLineParser)
    p = _leaf(tenant, "create", _tenant_create, common, "create a tenant")
    p.add_argument("name")
    p.add_argument("--class", dest="priority_class", default="standard", help="priority class (default standard)")
    p.add_argument("--weight", type=_positive, default=None, help="share within its class (default: class weight)")
    _leaf(tenant, "list", _tenant_list, common, "list tenants")
    _leaf(tenant, "show", _tenant_show, common, "show a tenant, its quota and keys").add_argument("name")
    p = _leaf(tenant, "update", _tenant_update, common, "change a tenant")
    p.add_argument("name")
    p.add_argument("--name", dest="new_name", default=None, help="rename")
    p.add_argument("--class", dest="priority_class", default=None)
    p.add_argument("--weight", type=_positive, default=None)
    for action, active in (("disable", False), ("enable", True)):
        p = _leaf(tenant, action, _tenant_status, common, f"{action} a tenant")
        p.add_argument("name")
        p.set_defaults(active=active)


def _add_key(groups, common: argparse.ArgumentParser) -> None:
    """``admin key``: create, list, revoke."""
    key = groups.add_parser("key", help="API keys").add_subparsers(dest="action", required=True, parser_class=_OneLineParser)
    p = _leaf(key, "create", _key_create, common, "create an API key (shown once)")
    p.add_argument("tenant")
    p.add_argument("--label", default=None, help="what the key is for (shown in listings and usage by key)")
    p.add_argument("--expires-in", default=None, metavar="DURATION",
                   help="the key stops working after this long: e.g. 90d, 12h, 30m (default: never)")
    _leaf(key, "list", _key_list, common, "list API keys").add_argument("tenant", nargs="?", default=None)
    _leaf(key, "revoke", _key_revoke, common, "revoke an API key by id or prefix").add_argument("key", type=_key_ref)


def _add_quota(groups, common: argparse.ArgumentParser) -> None:
    """``admin quota``: set, show."""
    quota = groups.add_parser("quota", help="quotas").add_subparsers(dest="action", required=True, parser_class=_OneLineParser)
    p = _leaf(quota, "set", _quota_set, common, "set limits ('none' clears a limit)")
    p.add_argument("tenant")
    for flag in QUOTA_FLAGS:
        p.add_argument("--" + flag.replace("_", "-"), dest=flag, type=QUOTA_TYPES.get(flag, _limit), default=_UNSET,
                       metavar="N|none", help=QUOTA_HELP.get(flag))
    p.add_argument("--batch-discount", type=_discount, default=_UNSET, metavar="F|none")
    p.add_argument("--cache-share", type=_share, default=_UNSET, metavar="F|none",
                   help="share of each engine's host and disk prefix-cache tiers and of its vision-encoder cache "
                        "the tenant may fill, in (0, 1]; past it, its new blocks and images evict only its own "
                        "(none: shared LRU; the encoder cache then applies the engine's --encoder-cache-tenant-share)")
    _leaf(quota, "show", _quota_show, common, "show a tenant's limits").add_argument("tenant")


def _add_class(groups, common: argparse.ArgumentParser) -> None:
    """``admin class``: create, list, update, set (service-level objectives)."""
    klass = groups.add_parser("class", help="priority classes").add_subparsers(dest="action", required=True, parser_class=_OneLineParser)
    p = _leaf(klass, "create", _class_create, common, "create a priority class")
    p.add_argument("name")
    # --rank: the flag's first name, still accepted (the database column keeps it).
    p.add_argument("--priority", "--rank", dest="priority", type=_priority, required=True,
                   help="lower is more urgent (0 first)")
    p.add_argument("--weight", type=_positive, default=1.0)
    _bool_pair(p, "preemptible", True)
    _bool_pair(p, "may-preempt", False)
    _leaf(klass, "list", _class_list, common, "list priority classes")
    p = _leaf(klass, "update", _class_update, common, "change a priority class")
    p.add_argument("name")
    p.add_argument("--priority", "--rank", dest="priority", type=_priority, default=None,
                   help="lower is more urgent (0 first)")
    p.add_argument("--weight", type=_positive, default=None)
    _bool_pair(p, "preemptible", None)
    _bool_pair(p, "may-preempt", None)
    p = _leaf(klass, "set", _class_set, common, "set a priority class's service-level objectives ('none' clears one)")
    p.add_argument("name")
    p.add_argument("--ttft-slo-ms", type=_objective_ms, default=_UNSET, metavar="MS|none",
                   help="time to first token objective, milliseconds")
    p.add_argument("--itl-slo-ms", type=_objective_ms, default=_UNSET, metavar="MS|none",
                   help="objective for a request's mean time between tokens, milliseconds")
    p.add_argument("--slo-action", choices=["refuse", "queue"], default=_UNSET,
                   help="a request predicted to miss its time to first token: refuse it at once (503 "
                        "slo_unattainable with Retry-After) or queue it (default)")


def _add_adapter(groups, common: argparse.ArgumentParser) -> None:
    """``admin adapter``: add, list, remove, grant, revoke."""
    adapter = groups.add_parser("adapter", help="LoRA adapters (a request names one as its model)").add_subparsers(
        dest="action", required=True, parser_class=_OneLineParser)
    p = _leaf(adapter, "add", _adapter_add, common,
              "register a PEFT LoRA adapter directory under NAME (checked first: a malformed one is refused)")
    p.add_argument("name", help="what requests send as their model")
    p.add_argument("--path", required=True, help="the directory save_pretrained wrote (adapter_config.json and "
                                                 "adapter_model.safetensors)")
    p.add_argument("--tenant", default=None, help="the owning tenant (others use it once granted)")
    p.add_argument("--public", action="store_true", help="every tenant may use it")
    _leaf(adapter, "list", _adapter_list, common, "list adapters (or those TENANT may use)").add_argument(
        "tenant", nargs="?", default=None)
    _leaf(adapter, "remove", _adapter_remove, common, "remove an adapter and its grants").add_argument("name")
    for action, grant in (("grant", True), ("revoke", False)):
        p = _leaf(adapter, action, _adapter_grant, common, f"{action} a tenant's use of an adapter it does not own")
        p.add_argument("name")
        p.add_argument("tenant")
        p.set_defaults(grant=grant)


def _add_replicas(groups) -> None:
    """``admin replicas``: a running gateway's replicas, listed or scaled (over HTTP, not the database)."""
    from tenants import replicas_cli

    replicas_cli.register(groups, _OneLineParser)


def _add_usage(groups, common: argparse.ArgumentParser) -> None:
    """``admin usage``: usage from the ledger."""
    p = groups.add_parser("usage", parents=[common], help="usage from the ledger")
    p.set_defaults(func=_admin_entry, admin_func=_usage)
    p.add_argument("tenant", nargs="?", default=None)
    p.add_argument("--since", type=_day, default=None, help="first day, YYYY-MM-DD (UTC)")
    p.add_argument("--until", type=_day, default=None, help="last day, inclusive")
    p.add_argument("--by", choices=["day", "key", "model", "adapter", "tenant", "class"], default="day")


def _add_db(subparsers, common: argparse.ArgumentParser) -> None:
    """``db``: schema migrations up and down."""
    db = subparsers.add_parser("db", help="database schema migrations")
    actions = db.add_subparsers(dest="db_action", required=True, parser_class=_OneLineParser)
    p = actions.add_parser("upgrade", parents=[common], help="migrate the schema up (default: to head)")
    p.add_argument("revision", nargs="?", default="head")
    p.set_defaults(func=_db_entry)
    p = actions.add_parser("downgrade", parents=[common], help="migrate the schema down (default: one step)")
    p.add_argument("revision", nargs="?", default="-1")
    p.set_defaults(func=_db_entry)
