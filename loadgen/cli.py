"""`moegate loadgen ...` subcommands: run, sweep, report, offline, compare-batching.

Errors in the user's input raise ValueError; ``moegate`` turns that into one
line on stderr and exit code 2 (argparse's own usage errors do the same).
"""

import argparse
import dataclasses
import json
import os

from loadgen import compare_batching, offline

ENV_KEYS = ("MOEGATE_API_KEY", "OPENAI_API_KEY")


def _add_load_args(p: argparse.ArgumentParser) -> None:
    """Flags of online runs. Single-tenant flags default to None so that a scenario file can refuse them."""
    g = p.add_argument_group("target")
    g.add_argument("--base-url", default=None, help="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    g.add_argument("--api-key", default=None, help=f"bearer key (default: ${ENV_KEYS[0]} or ${ENV_KEYS[1]})")
    g.add_argument("--model", default=None, help="sent as the request's model")
    g.add_argument("--scenario", default=None, help="multi-tenant scenario, YAML or JSON (see loadgen/scenario.py)")
    g = p.add_argument_group("load (single tenant)")
    g.add_argument("--rate", type=float, default=None, help="requests/s")
    g.add_argument("--arrival", choices=["poisson", "gamma", "constant", "throughput"], default=None,
                   help="arrival process for --rate (default poisson); throughput: all requests at once")
    g.add_argument("--burstiness", type=float, default=None, help="gamma shape: 1 = Poisson, < 1 burstier")
    g.add_argument("--concurrency", type=int, default=None, help="closed loop: keep N requests in flight")
    g.add_argument("--ramp-to", type=float, default=None, help="ramp the rate linearly to this many requests/s ...")
    g.add_argument("--ramp-s", type=float, default=None, help="... over this many seconds")
    g.add_argument("--num-requests", type=int, default=None, help="stop sending after N requests (default 100)")
    g.add_argument("--duration", default=None, help="stop sending after this long (e.g. 60s, 5m)")
    g.add_argument("--tenant-name", default=None, help="label of the single tenant (default 'default')")
    g.add_argument("--priority", default=None, help="priority class label to group results by")
    g = p.add_argument_group("dataset (single tenant)")
    g.add_argument("--dataset", choices=["synthetic", "sharegpt", "shared-prefix"], default=None)
    g.add_argument("--input-len", default=None, help="e.g. 256, uniform:16,512, normal:256,64, hist:16-64=3,64-512=1")
    g.add_argument("--output-len", default=None, help="same forms as --input-len (default uniform:8,256)")
    g.add_argument("--sharegpt-path", default=None, help="ShareGPT-format JSON file")
    g.add_argument("--num-prefixes", type=int, default=None, help="shared-prefix: distinct system prompts")
    g.add_argument("--prefix-len", type=int, default=None, help="shared-prefix: tokens per system prompt")
    g.add_argument("--tokenizer", default=None, help="tokenizer.json (or its directory) for exact prompt lengths")
    g.add_argument("--images", type=int, default=None, help="random-pixel PNG images per request (needs --api chat)")
    g.add_argument("--image-size", default=None, help="WxH, or several separated by commas (default 448x448)")
    g.add_argument("--image-repeat", type=float, default=None,
                   help="share of images drawn from a pool sent again and again; the rest are new (default 0.5)")
    g.add_argument("--image-pool", type=int, default=None, help="distinct images that repeat (default 8)")
    g = p.add_argument_group("requests (single tenant)")
    g.add_argument("--api", choices=["completion", "chat"], default=None)
    g.add_argument("--no-stream", action="store_true", default=None)
    g.add_argument("--max-tokens", type=int, default=None, help="fixed max_tokens (overrides --output-len)")
    g.add_argument("--ignore-eos", action="store_true", default=None, help="send ignore_eos (vLLM, moegate)")
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--honour-retry-after", "--honor-retry-after", dest="honour_retry_after", action="store_true",
                   default=None, help="on 429/503 with Retry-After, wait and retry")
    g.add_argument("--max-retries", type=int, default=None, help="retries per request with --honour-retry-after (3)")
    g.add_argument("--timeout", default=None, help="per-request timeout (default 300s)")
    g = p.add_argument_group("results")
    g.add_argument("--slo", default=None, help="goodput bounds, e.g. ttft=500ms,tpot=50ms (keys ttft, tpot, itl, e2e)")
    g.add_argument("--seed", type=int, default=None, help="prompts and arrival times follow it (default 0)")
    g.add_argument("--warmup", type=int, default=None, help="unmeasured requests per tenant sent first, one at a time")
    g.add_argument("--out", default=None, help="directory for results.json, results.csv and report.html")
    g.add_argument("--json", action="store_true", help="print the analysis as JSON instead of tables")
    g.add_argument("--no-progress", action="store_true", help="no live progress bar")


_SINGLE_TENANT_FLAGS = ("rate", "arrival", "burstiness", "concurrency", "ramp_to", "ramp_s", "num_requests",
                        "tenant_name", "priority", "dataset", "input_len", "output_len", "sharegpt_path",
                        "num_prefixes", "prefix_len", "tokenizer", "images", "image_size", "image_repeat",
                        "image_pool", "api", "no_stream", "max_tokens", "ignore_eos",
                        "temperature", "honour_retry_after", "max_retries", "timeout", "api_key", "model")


def scenario_from_args(args: argparse.Namespace):
    """The scenario of an online command: the file's, or one tenant from the flags."""
    from loadgen.arrivals import ArrivalConfig
    from loadgen.client import RequestOptions
    from loadgen.datasets import DatasetConfig
    from loadgen.scenario import Scenario, TenantSpec, load_scenario, parse_duration, parse_slo

    duration = parse_duration(args.duration) if args.duration is not None else None
    if args.scenario:
        given = [f"--{f.replace('_', '-')}" for f in _SINGLE_TENANT_FLAGS if getattr(args, f) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} apply only without --scenario (set them in the scenario file)")
        scenario = load_scenario(args.scenario, base_url=args.base_url, duration_s=duration, seed=args.seed)
        changes = {"slo": parse_slo(args.slo)} if args.slo is not None else {}
        if args.warmup is not None:
            changes["warmup"] = args.warmup
        return dataclasses.replace(scenario, **changes)  # validated again
    if not args.base_url:
        raise ValueError("--base-url is required (or --scenario with base_url)")
    if args.concurrency is not None and (args.rate is not None or args.arrival is not None):
        raise ValueError("--concurrency is a closed loop: give it without --rate/--arrival")
    if args.concurrency is not None:
        arrival = ArrivalConfig("concurrency", concurrency=args.concurrency)
    elif args.arrival == "throughput":
        arrival = ArrivalConfig("throughput")
    elif args.rate is None:
        raise ValueError("give --rate R (requests/s) or --concurrency N (or --arrival throughput)")
    else:
        ramp_s = args.ramp_s
        arrival = ArrivalConfig(args.arrival or "poisson", args.rate,
                                args.burstiness if args.burstiness is not None else 1.0, None, args.ramp_to, ramp_s)
    dataset = DatasetConfig(
        kind=args.dataset or ("sharegpt" if args.sharegpt_path else "synthetic"),
        input_len=args.input_len or ("64" if args.dataset == "shared-prefix" else "uniform:16,512"),
        output_len=args.output_len or "uniform:8,256", path=args.sharegpt_path,
        num_prefixes=args.num_prefixes or 4, prefix_len=args.prefix_len or 512, tokenizer=args.tokenizer,
        sharegpt_output_len=args.output_len is None, images=args.images or 0,
        image_size=args.image_size or "448x448",
        image_repeat=args.image_repeat if args.image_repeat is not None else 0.5,
        image_pool=args.image_pool if args.image_pool is not None else 8,
    )
    key = args.api_key or next((os.environ[k] for k in ENV_KEYS if os.environ.get(k)), None)
    options = RequestOptions(
        api=args.api or "completion", stream=not args.no_stream, model=args.model, ignore_eos=bool(args.ignore_eos),
        temperature=args.temperature, max_tokens=args.max_tokens, honour_retry_after=bool(args.honour_retry_after),
        max_retries=args.max_retries if args.max_retries is not None else 3,
        timeout_s=parse_duration(args.timeout) if args.timeout is not None else 300.0,
    )
    num_requests = args.num_requests if args.num_requests is not None else (None if duration else 100)
    tenant = TenantSpec(args.tenant_name or "default", key, args.priority, 1.0, arrival, dataset, options, num_requests)
    return Scenario(args.base_url, [tenant], duration, args.seed or 0, parse_slo(args.slo), args.model, args.warmup or 0)


def _write_outputs(out: str | None, result) -> None:
    if not out:
        return
    from loadgen.report import run_body, write_csv, write_json
    from loadgen.report_html import run_report_html

    os.makedirs(out, exist_ok=True)
    body = run_body(result)
    write_json(os.path.join(out, "results.json"), "run", body)
    write_csv(os.path.join(out, "results.csv"), result.records)
    with open(os.path.join(out, "report.html"), "w", encoding="utf-8") as f:
        f.write(run_report_html(body))
    print(f"wrote {out}/results.json, results.csv, report.html")


def _run_main(args: argparse.Namespace) -> int:
    from loadgen.report import print_run_summary
    from loadgen.runner import run

    scenario = scenario_from_args(args)
    result = run(scenario, show_progress=not args.no_progress and not args.json)
    if args.json:
        print(json.dumps({k: v for k, v in result.analysis.items() if k != "timeseries"}, indent=1))
    else:
        print_run_summary(result)
    _write_outputs(args.out, result)
    return 0 if result.analysis["overall"]["ok"] or result.batch_jobs else 1


def _sweep_main(args: argparse.Namespace) -> int:
    from loadgen.report import print_table, run_body, write_json
    from loadgen.sweep import SWEEP_COLUMNS, run_sweep, sweep_html, sweep_rows

    if args.rate is not None or args.concurrency is not None or args.arrival == "throughput":
        raise ValueError("sweep chooses the rates itself: leave out --rate, --concurrency and --arrival throughput")
    if args.scenario:
        raise ValueError("sweep drives one tenant: leave out --scenario")
    args.rate = 1.0  # placeholder: each step sets its own rate
    scenario = scenario_from_args(args)

    def progress(step) -> None:
        label, rate, result = step
        o = result.analysis["overall"]
        print(f"{label:24s} offered {'max' if rate is None else f'{rate:.2f}':>6} req/s -> "
              f"{o['request_throughput']:.2f} req/s, {o['output_token_throughput']:.1f} tok/s", flush=True)

    steps = run_sweep(scenario, args.sweep_points, not args.no_progress and not args.json, on_step=progress)
    print_table("Sweep", SWEEP_COLUMNS, sweep_rows(steps))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        write_json(os.path.join(args.out, "sweep.json"), "sweep", {"steps": [
            {"label": label, "offered_rate": rate, **run_body(result)} for label, rate, result in steps]})
        with open(os.path.join(args.out, "sweep.html"), "w", encoding="utf-8") as f:
            f.write(sweep_html(steps, scenario.target_url))
        print(f"wrote {args.out}/sweep.json, sweep.html")
    return 0


def _report_main(args: argparse.Namespace) -> int:
    from loadgen.report_html import run_report_html

    try:
        with open(args.results, encoding="utf-8") as f:
            body = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {args.results}: {e}") from None
    if body.get("kind") != "run":
        raise ValueError(f"{args.results} is not the results.json of `moegate loadgen run`")
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(run_report_html(body))
    print(f"wrote {args.output}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("loadgen", help="load generation and benchmarks")
    sub = p.add_subparsers(dest="loadgen_command", required=True)
    r = sub.add_parser("run", help="drive an OpenAI-compatible server (one tenant from flags, or --scenario)")
    _add_load_args(r)
    r.set_defaults(func=_run_main)
    s = sub.add_parser("sweep", help="find the saturation rate, then measure rates below it")
    _add_load_args(s)
    s.add_argument("--sweep-points", type=int, default=4, help="rates below saturation (default 4: 20..80%%)")
    s.set_defaults(func=_sweep_main)
    rep = sub.add_parser("report", help="rebuild report.html from a results.json")
    rep.add_argument("results")
    rep.add_argument("-o", "--output", default="report.html")
    rep.set_defaults(func=_report_main)
    offline.register(sub)
    compare_batching.register(sub)
