"""``moegate admin replicas``: list a running gateway's engine replicas; ``moegate admin replicas set N``: scale
them while it serves. Unlike the other admin commands these talk to the gateway (``/admin/replicas``, with
``$MOEGATE_ADMIN_TOKEN``), not to the database: the replicas are the gateway's processes.

Bad input (a count below 1 or above the gateway's bound, no token, a gateway that cannot be reached or refuses)
exits 2 with one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request

TOKEN_ENV = "MOEGATE_ADMIN_TOKEN"
DEFAULT_URL = "http://127.0.0.1:8000"
TIMEOUT_S = 600.0  # a shrink waits for the leaving replicas' requests (the gateway's --drain-timeout)

COLUMNS = ["replica", "state", "in_flight", "routed"]


class _Refused(Exception):
    """One line for stderr, exit 2."""


def _call(url: str, body: dict | None) -> dict:
    token = os.environ.get(TOKEN_ENV)
    if not token:
        raise _Refused(f"set {TOKEN_ENV} to the gateway's admin token")
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{url.rstrip('/')}/admin/replicas", data=data,
                                     method="GET" if body is None else "POST",
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        raise _Refused(f"the gateway answered {e.code}: {message}") from None
    except (urllib.error.URLError, OSError) as e:
        raise _Refused(f"cannot reach the gateway at {url}: {getattr(e, 'reason', e)}") from None


def _show(args: argparse.Namespace, reply: dict) -> None:
    if args.json:
        print(json.dumps(reply, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    title = f"{reply['count']} serving (at most {reply['max_count']})"
    if reply.get("seconds") is not None:
        title += f"; done in {reply['seconds']:.1f} s"
    table = Table(title=title)
    for c in COLUMNS:
        table.add_column(c)
    for r in reply["replicas"]:
        table.add_row(*["-" if r.get(c) is None else str(r.get(c)) for c in COLUMNS])
    Console(soft_wrap=True).print(table)


def _entry(args: argparse.Namespace) -> int:
    try:
        if args.count is not None and args.count < 1:
            raise _Refused(f"the count must be 1 or more, got {args.count}")
        body = None if args.count is None else {"count": args.count}
        if body is not None and args.drain_timeout is not None:
            body["drain_timeout_s"] = args.drain_timeout
        _show(args, _call(args.url, body))
        return 0
    except _Refused as e:
        print(f"moegate admin replicas: error: {e}", file=sys.stderr)
        return 2


def _flags(url_default, json_default) -> argparse.ArgumentParser:
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--url", default=url_default, help=f"the gateway (default {DEFAULT_URL})")
    flags.add_argument("--json", action="store_true", default=json_default, help="machine-readable output")
    return flags


def register(groups, parser_class) -> None:
    """Add ``replicas`` (list) and ``replicas set N`` to the ``moegate admin`` groups."""
    p = groups.add_parser("replicas", parents=[_flags(DEFAULT_URL, False)],
                          help="a running gateway's engine replicas (list; set N)")
    p.set_defaults(func=_entry, count=None, drain_timeout=None)
    actions = p.add_subparsers(dest="action", required=False, parser_class=parser_class)
    # The flags again after `set`, without defaults: given before `set`, they are kept.
    s = actions.add_parser("set", parents=[_flags(argparse.SUPPRESS, argparse.SUPPRESS)], help="scale to N serving replicas while serving; shrinking "
                                                          "waits for the leaving replicas' requests")
    s.add_argument("count", type=int, help="1 to the gateway's --max-data-parallel-size")
    s.add_argument("--drain-timeout", type=float, default=None, metavar="SECONDS",
                   help="how long leaving replicas may finish their requests before those are cut (default: the "
                        "gateway's --drain-timeout)")
    s.set_defaults(func=_entry)
