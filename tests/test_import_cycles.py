"""No import circles among product modules: the graph read from the source (every import, function-level ones
included, since a lazy import is still a circle waiting for its caller) has no cycle, and every module imports
in a fresh interpreter, one after another in reverse order (a module's dependents first)."""

import ast
import pathlib
import subprocess
import sys

from tests.test_layering import PRODUCT, ROOT

# Scripts that do their work on import: Alembic runs env.py itself; __main__ runs the command.
NOT_IMPORTABLE = ("migrations.env", "gateway.cli.__main__")


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package in PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imported(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The product modules ``name`` imports: ``from a.b import c`` is ``a.b.c`` when that is a module, else ``a.b``."""
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in modules else base)
    return {m for m in out if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected component of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_product_module_imports_itself_through_others():
    modules = _modules()
    assert len(modules) > 100 and "gateway.cli.serve" in modules
    graph = {name: _imported(name, path, modules) for name, path in modules.items()}
    assert "engine.engine_flags" in graph["gateway.cli.serve"]  # the reader sees imports
    assert _cycles(graph) == []


def test_every_product_module_imports_alone_in_reverse_order():
    names = sorted((m for m in _modules() if m not in NOT_IMPORTABLE), reverse=True)
    script = ("import importlib, sys, traceback\nfailed = []\n"
              f"for name in {names!r}:\n"
              "    try:\n        importlib.import_module(name)\n"
              "    except Exception:\n        failed.append(name + ': ' + traceback.format_exc(limit=-2))\n"
              "print('\\n'.join(failed)); sys.exit(1 if failed else 0)\n")
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
