"""``gpu_session.sh --dry-run``: every stage's commands checked on the CPU, in seconds, before a GPU minute is spent.

The script runs its stages with ``PY`` pointing here (``python benchmarks/dry_run.py --record FILE``), so each
``$PY -m MODULE ARGS...`` a stage would run is only written down, with the arguments exactly as the shell
expanded them. Then ``--check FILE`` imports every module named and parses each command's arguments with the
module's own ``argparse`` parser, stopping right after the parse: a misspelt module, a missing import or a flag
the benchmark does not take fails here (exit 1, one line per bad command) instead of on the GPU. For ``pytest``
every test file (and ``--deselect``) named must exist, and a ``::test`` named must be defined in its file.
"""

import argparse
import contextlib
import importlib
import io
import json
import os
import re
import runpy
import sys


class _Parsed(Exception):
    """Raised by the patched parser once a command's arguments have parsed."""


def record(path: str, argv: list[str]) -> int:
    """Write ``argv`` (what ``python`` was given) down as one JSON line; ``-c`` snippets are not checked."""
    if argv[:1] == ["-m"] and len(argv) > 1:
        with open(path, "a") as f:
            f.write(json.dumps({"module": argv[1], "args": argv[2:]}) + "\n")
    return 0


def _parse_only(module: str, args: list[str]) -> str | None:
    """Run ``python -m module args`` until its parser has parsed; None if it parsed, else what went wrong."""
    real_known, real_full = argparse.ArgumentParser.parse_known_args, argparse.ArgumentParser.parse_args
    inside_full = [0]  # parse_args calls parse_known_args, then refuses what is left over

    def known_then_stop(self, args=None, namespace=None):
        result = real_known(self, args, namespace)
        if not inside_full[0]:
            raise _Parsed()
        return result

    def full_then_stop(self, args=None, namespace=None):
        inside_full[0] += 1
        try:
            real_full(self, args, namespace)
        finally:
            inside_full[0] -= 1
        raise _Parsed()

    argparse.ArgumentParser.parse_known_args = known_then_stop
    argparse.ArgumentParser.parse_args = full_then_stop
    saved_argv = sys.argv
    sys.argv = [module, *args]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        return "ran to the end without parsing any arguments"
    except _Parsed:
        return None
    except SystemExit as e:  # argparse's error exit (a flag the module does not take), or the module's own exit
        lines = err.getvalue().strip().splitlines()
        return f"exited {e.code} while parsing: {lines[-1] if lines else 'no message'}"
    except Exception as e:  # an import that fails, say
        return f"{type(e).__name__}: {e}"
    finally:
        argparse.ArgumentParser.parse_known_args, argparse.ArgumentParser.parse_args = real_known, real_full
        sys.argv = saved_argv


def _missing_tests(args: list[str]) -> str | None:
    """The first test path (or ``path::test``) in pytest's ``args`` that does not exist; None if all do."""
    takes_value = {"-k", "-m", "-p", "-n", "--durations", "--dist", "--timeout", "-W", "-o"}
    skip_next = False
    for arg in args:
        if skip_next:
            skip_next = False
            continue
        if arg in takes_value:
            skip_next = True
            continue
        if arg.startswith("-") and arg != "--deselect":
            continue
        if arg == "--deselect":
            continue  # the next argument is a path, checked like the others
        file, _, test = arg.partition("::")
        if not os.path.exists(file):
            return f"no such test path: {file}"
        if test and os.path.isfile(file):
            name = test.split("::")[-1].split("[")[0]
            with open(file) as f:
                if not re.search(rf"^\s*(def|class) {re.escape(name)}\b", f.read(), re.M):
                    return f"{file} defines no {name}"
    return None


def check(path: str) -> int:
    with open(path) as f:
        commands = [json.loads(line) for line in f if line.strip()]
    bad = 0
    for command in commands:
        module, args = command["module"], command["args"]
        try:
            importlib.import_module(module)
        except Exception as e:
            problem = f"cannot import: {type(e).__name__}: {e}"
        else:
            problem = _missing_tests(args) if module == "pytest" else _parse_only(module, args)
        if problem:
            bad += 1
            print(f"dry run: {' '.join(['python -m', module, *args])}: {problem}")
    print(f"dry run: {len(commands) - bad} of {len(commands)} commands parse")
    return 1 if bad or not commands else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--record"] and len(argv) >= 2:
        return record(argv[1], argv[2:])
    if argv[:1] == ["--check"] and len(argv) == 2:
        return check(argv[1])
    print("usage: dry_run.py --record FILE -m MODULE ARGS... | --check FILE", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
