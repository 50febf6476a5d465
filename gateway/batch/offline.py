"""`moegate run-batch -i in.jsonl -o out.jsonl`: a Batch API input file run offline, no server.

Same validation and the same per-line execution as the server's batch runner
(``execute_line``: the live API's body decoding, engine call and response
shape), against an engine process started here. Output lines follow the input
order; lines that fail go to the error file, as the Batch API does.
"""

import argparse
import asyncio
import json
import sys
from pathlib import Path

from engine import engine_flags
from engine.core.config import EngineConfig
from gateway.config import GatewayConfig


def register(subparsers) -> None:
    p = subparsers.add_parser("run-batch", help="run a Batch API input file offline (no server)")
    p.add_argument("-i", "--input", required=True, help="input .jsonl (Batch API format)")
    p.add_argument("-o", "--output", required=True, help="output .jsonl (one line per successful request)")
    p.add_argument("--errors", default=None, help="error .jsonl (default: OUTPUT with .errors.jsonl)")
    p.add_argument("--max-lines", type=int, default=GatewayConfig().batch_max_lines,
                   help="refuse an input file of more lines (the Batch API's limit; default %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no live progress bar")
    engine_flags.add_engine_flags(p, exclude=engine_flags.REPLICA_FIELDS)
    p.set_defaults(func=_run_batch)


def _run_batch(args: argparse.Namespace) -> int:
    from gateway.batch.validation import validate_batch_file

    src = Path(args.input)
    if not src.is_file():
        raise ValueError(f"input file {src} does not exist")
    data = src.read_bytes()
    first = next((l for l in data.splitlines() if l.strip()), b"{}")
    try:
        endpoint = json.loads(first).get("url", "/v1/completions")
    except (ValueError, AttributeError):
        endpoint = "/v1/completions"
    checked = validate_batch_file(data, endpoint, None, args.max_lines, 1024)
    if not checked.ok:
        for e in checked.errors:
            print(f"moegate run-batch: {src}:{e['line'] or '-'}: {e['code']}: {e['message']}", file=sys.stderr)
        return 2
    from engine.loading.model_check import check_model

    config = engine_flags.engine_config(args)
    check_model(config)  # a bad checkpoint is one line, exit 2
    errors_path = Path(args.errors) if args.errors else Path(args.output).with_suffix(".errors.jsonl")
    ok, failed = asyncio.run(_execute(config, endpoint, checked, Path(args.output), errors_path, not args.no_progress))
    print(f"{ok} succeeded -> {args.output}" + (f", {failed} failed -> {errors_path}" if failed else ""))
    return 0


async def _execute(config: EngineConfig, endpoint: str, checked, out_path: Path, errors_path: Path,
                   progress: bool) -> tuple[int, int]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    from engine.core.request_policy import RequestPolicy
    from engine.serving.async_engine import AsyncEngine
    from gateway.batch.runner import execute_line

    engine = AsyncEngine(config)
    await engine.start()
    model = checked.model or Path(config.model).name
    results: list[tuple[bool, dict] | None] = [None] * len(checked.lines)
    limit = asyncio.Semaphore(2 * config.max_num_seqs)  # enough queued to keep every batch slot busy
    try:
        with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                      TimeRemainingColumn(), disable=not progress) as bar:
            task = bar.add_task("requests", total=len(checked.lines))

            async def run(i: int, line) -> None:
                async with limit:
                    ok, result, _ = await execute_line(engine, model, endpoint, line.custom_id, line.body_json,
                                                       RequestPolicy(priority=2, tenant="offline"))
                results[i] = (ok, result)
                bar.advance(task)

            await asyncio.gather(*(run(i, line) for i, line in enumerate(checked.lines)))
    finally:
        await engine.shutdown()
    good = [json.dumps(r) for ok, r in results if ok]
    bad = [json.dumps(r) for ok, r in results if not ok]
    out_path.write_text("".join(l + "\n" for l in good))
    if bad:
        errors_path.write_text("".join(l + "\n" for l in bad))
    return len(good), len(bad)
