"""Small helpers for the tenants tests: run a coroutine against a store, run the CLI in-process."""

from __future__ import annotations

import argparse
import asyncio
import json

from tenants import cli as tenants_cli
from tenants.store import TenantStore


def with_store(url: str, body):
    """Run ``await body(store)`` in a fresh event loop with a store that is closed afterwards."""

    async def main():
        store = TenantStore.open(url)
        try:
            return await body(store)
        finally:
            await store.close()

    return asyncio.run(main())


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moegate")
    tenants_cli.register(parser.add_subparsers(dest="command", required=True))
    return parser


def cli(capsys, url: str | None, *argv: str, as_json: bool = False) -> tuple[int, str, str]:
    """Run ``moegate ARGV`` and return (exit code, stdout, stderr); parsed JSON stdout if ``as_json``."""
    argv = list(argv) + (["--database-url", url] if url else []) + (["--json"] if as_json else [])
    try:
        args = make_parser().parse_args(argv)
        code = args.func(args)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, (json.loads(out) if as_json and code == 0 else out), err


async def tenant_key(url: str, name: str = "t", **quota) -> str:
    """Create tenant ``name`` (with ``quota`` limits, if any) and return a fresh API key of it."""
    store = TenantStore.open(url)
    try:
        await store.create_tenant(name)
        if quota:
            await store.set_quota(name, **quota)
        return (await store.create_key(name))[1]
    finally:
        await store.close()
