"""The house rules, read from the source: product packages never import measurement or test code, no two
packages import each other, the request/scheduling modules stay free of torch, and nothing imports a module that
slows every process start for nothing."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PRODUCT = ("engine", "moe_kernels", "tenants", "gateway", "loadgen", "migrations")
# Request bookkeeping, scheduling and prompt preparation: the gateway runs some of it in its own process,
# and none of it needs a device.
TORCH_FREE_ROOMS = ("engine/core", "engine/text")
TORCH_FREE = tuple(sorted(str(f.relative_to(ROOT)) for room in TORCH_FREE_ROOMS for f in (ROOT / room).rglob("*.py"))) + (
    "engine/serving/protocol.py",)


def _imports(path: pathlib.Path) -> set[str]:
    """Top-level module names ``path`` imports (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def _package_imports() -> dict[str, dict[str, set[str]]]:
    """package -> {file: the other product packages it imports}, plus each file's full import set."""
    out = {}
    for package in PRODUCT:
        files = sorted((ROOT / package).rglob("*.py"))
        assert files, package
        out[package] = {str(f.relative_to(ROOT)): _imports(f) for f in files}
    return out


def test_product_code_never_imports_benchmarks_or_tests():
    bad = [f"{f}: {m}" for files in _package_imports().values() for f, mods in files.items()
           for m in mods if m.split(".")[0] in ("benchmarks", "tests")]
    assert bad == []


def test_no_two_packages_import_each_other():
    edges = {(p, m.split(".")[0]) for p, files in _package_imports().items() for mods in files.values()
             for m in mods if m.split(".")[0] in PRODUCT and m.split(".")[0] != p}
    both_ways = sorted((a, b) for a, b in edges if (b, a) in edges and a < b)
    assert both_ways == [], both_ways


def test_request_and_scheduling_modules_do_not_import_torch():
    assert len(TORCH_FREE) > 10, TORCH_FREE
    bad = [f"{f}: {m}" for f in TORCH_FREE for m in _imports(ROOT / f) if m.split(".")[0] in ("torch", "triton")]
    assert bad == []


def test_no_product_module_imports_llguidance_torch():
    """Importing llguidance.torch decorates a kernel with torch.compile, which loads torch._dynamo: ~1.8 s added to
    every engine and rank process start for a kernel the engine does not use (it fills masks with llguidance.numpy)."""
    bad = [f"{f}: {m}" for files in _package_imports().values() for f, mods in files.items() for m in mods
           if m == "llguidance.torch"]
    assert bad == []
