"""Compile every Triton launch the CPU tests make for a Hopper GPU (sm_90), on a machine without one.

    python -m benchmarks.triton_compile_check [--arch 90] [--keep PATH] [TEST_PATH ...]

Triton's interpreter (TRITON_INTERPRET=1, how the kernels run in CI) accepts programs the GPU compiler refuses:
``tl.dot`` with a dimension under 16, dtype mismatches in ``tl.dot``, ``tl.arange`` bounds that are not
powers of two, and so on. A refusal found on the first lent GPU costs its minutes; found here it costs none.

Two steps, each in a process of its own (``triton.jit`` picks interpreted or compiled when a kernel module is
imported, so the two cannot share one):

1. record: the named tests (default: the kernel tests) run under the interpreter with every kernel launch
   written down: the kernel, each argument's type (a pointer's dtype, an integer's width, a float) and every
   ``tl.constexpr`` value, with ``num_warps`` and ``num_stages``;
2. compile: each distinct launch is compiled ahead of time for ``cuda`` sm_``--arch`` through Triton's own
   compiler and ``ptxas`` (both ship in the triton wheel; no driver, no GPU).

Exit 1 lists each launch that failed to compile with the compiler's message; 0 when all compiled.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

DEFAULT_TESTS = (
    "tests/moe_kernels/test_triton.py",
    "tests/moe_kernels/test_mxfp4.py",
    "tests/moe_kernels/test_swapped.py",
    "tests/moe_kernels/test_int4.py",
    "tests/moe_kernels/test_routing_kinds.py",
    "tests/engine/kernels",
)

# torch dtype name -> Triton signature type.
_POINTER_TYPES = {
    "float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64",
    "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64", "uint8": "u8", "bool": "i1",
    "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5",
}


def _arg_type(value) -> str | None:
    """Triton's signature type of one runtime argument; None for one this check cannot describe."""
    import torch

    if isinstance(value, torch.Tensor):
        return "*" + _POINTER_TYPES[str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    return None


def install_recorder(path: str) -> None:
    """Patch the interpreter so that every kernel launch appends one JSON line to ``path``."""
    import triton.runtime.interpreter as interpreter

    real_run = interpreter.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        params = list(zip(self.arg_names, args)) + [(k, v) for k, v in kwargs.items() if k in self.arg_names]
        annotations = getattr(fn, "__annotations__", {})
        signature, constexprs = {}, {}
        for name, value in params:
            if "constexpr" in str(annotations.get(name, "")) or value is None:
                constexprs[name] = value if isinstance(value, (int, float, bool, str, type(None))) else str(value)
                signature[name] = "constexpr"
            else:
                signature[name] = _arg_type(value) or "unknown"
        record = {"module": fn.__module__, "kernel": fn.__qualname__, "signature": signature,
                  "constexprs": constexprs, "num_warps": kwargs.get("num_warps", 4),
                  "num_stages": kwargs.get("num_stages", 3)}
        with open(path, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = run


def compile_all(records: list[dict], arch: int) -> list[tuple[dict, str]]:
    """Compile each distinct record for cuda sm_``arch``; the (record, message) pairs that failed."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    failures = []
    for record in records:
        kernel = importlib.import_module(record["module"])
        for part in record["kernel"].split("."):
            kernel = getattr(kernel, part)
        signature = {name: ("*i8" if kind == "unknown" else kind) for name, kind in record["signature"].items()}
        try:
            source = ASTSource(fn=kernel, signature=signature, constexprs=record["constexprs"])
            triton.compile(source, target=target,
                           options={"num_warps": record["num_warps"], "num_stages": record["num_stages"]})
        except Exception as e:  # the compiler's refusal, whatever its class
            failures.append((record, f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"))
    return failures


def distinct(lines: list[str]) -> list[dict]:
    """The distinct launches; a line cut short (the recording run killed at its limit mid-write) is dropped."""
    records = []
    for line in sorted(set(lines)):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.triton_compile_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("tests", nargs="*", help=f"test paths to record launches from (default: {' '.join(DEFAULT_TESTS)})")
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability to compile for (90: Hopper)")
    parser.add_argument("--keep", metavar="PATH", help="also write the distinct launches as JSON lines to PATH")
    parser.add_argument("--compile-only", metavar="LAUNCHES", help=argparse.SUPPRESS)  # step 2, in its own process
    parser.add_argument("--timeout", type=int, default=900,
                        help="seconds for the recording run of the tests; at the limit, what ran is compiled")
    args = parser.parse_args(argv)

    if args.compile_only:
        with open(args.compile_only) as f:
            records = distinct(f.readlines())
        started = time.perf_counter()
        failures = compile_all(records, args.arch)
        for record, message in failures:
            print(f"FAILED {record['kernel']} constexprs={record['constexprs']} "
                  f"warps={record['num_warps']} stages={record['num_stages']}: {message}")
        print(f"triton_compile_check: {len(records) - len(failures)} of {len(records)} distinct launches compile "
              f"for sm_{args.arch} ({time.perf_counter() - started:.0f} s)")
        return 1 if failures or not records else 0

    with tempfile.TemporaryDirectory() as tmp:
        launches = os.path.join(tmp, "launches.jsonl")
        env = {**os.environ, "TRITON_INTERPRET": "1", "MOEGATE_TRITON_LAUNCHES": launches,
               "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "benchmarks.triton_compile_check",
                   *(args.tests or DEFAULT_TESTS)]
        try:
            recorded = subprocess.run(command, env=env, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:  # what ran so far is still worth compiling
            recorded = f"timed out after {args.timeout} s"
        if recorded != 0:  # a failing test still recorded its launches
            print(f"triton_compile_check: the recording test run did not pass ({recorded}); compiling what it launched")
        if not os.path.exists(launches):
            print("triton_compile_check: no kernel was launched")
            return 1
        if args.keep:
            with open(launches) as f, open(args.keep, "w") as out:
                out.writelines(line if line.endswith("\n") else line + "\n" for line in sorted(set(f)))
        env.pop("TRITON_INTERPRET")
        compiled = subprocess.run([sys.executable, "-m", "benchmarks.triton_compile_check", "--arch", str(args.arch),
                                   "--compile-only", launches], env=env).returncode
        return compiled or (0 if recorded == 0 else 1)


# Loaded by pytest as a plugin (-p benchmarks.triton_compile_check) in step 1.
if os.environ.get("MOEGATE_TRITON_LAUNCHES") and os.environ.get("TRITON_INTERPRET") == "1":
    install_recorder(os.environ["MOEGATE_TRITON_LAUNCHES"])


if __name__ == "__main__":
    sys.exit(main())
