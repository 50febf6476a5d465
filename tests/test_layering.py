"""The house rules, read from the source: product packages never import measurement or test code, no two
packages import each other, the engine's rooms import only rooms below them, the request/scheduling modules stay
free of torch, and nothing imports a module that slows every process start for nothing."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PRODUCT = ("engine", "moe_kernels", "tenants", "gateway", "loadgen", "migrations")
# Request bookkeeping, scheduling and prompt preparation: the gateway runs some of it in its own process,
# and none of it needs a device.
TORCH_FREE_ROOMS = ("engine/core", "engine/text")
TORCH_FREE = tuple(sorted(str(f.relative_to(ROOT)) for room in TORCH_FREE_ROOMS for f in (ROOT / room).rglob("*.py"))) + (
    "engine/serving/protocol.py",)


# The engine's rooms, lowest first: a module may import its own layer and the layers below, never one above. Every
# file of the engine is in one, with no exceptions. Process utilities (starting a process from the forkserver,
# ending with its starter) sit at the bottom; request state, the engine's and a checkpoint's configs and text
# (the gateway runs them) next; then what one forward reads, the grammar and sampling math, the collectives the
# layers call, the kernels, the layers built on them, image preprocessing and the vision towers, the models built from layers, the expert load (measured and
# balanced), building a model from a checkpoint, the transforms applied to a loaded model, the worker that runs a
# step, the KV caches as bytes and as tiers, the ranks of an engine over several processes (starting them; a
# follower's loop, which builds its rank as the engine builds its own), the engine that steps, the engine as a
# process, and the command-line entry points and the package's lazy names at the top.
ENGINE_LAYERS = (
    ("engine/processes",),
    ("engine/text",),
    ("engine/core",),
    ("engine/device_batch",),
    ("engine/structured_output",),
    ("engine/sampling",),
    ("engine/distributed",),
    ("engine/kernels",),
    ("engine/lora",),
    ("engine/layers",),
    ("engine/vision",),  # image preprocessing and vision towers: the multimodal models build on them
    ("engine/models",),
    ("engine/eplb",),
    ("engine/loading",),
    ("engine/transforms",),
    ("engine/worker",),
    ("engine/kv_transfer",),  # reads and writes the worker's KV caches as bytes; the serving room drives it
    ("engine/kv_tiers",),  # the prefix-cache tiers: the engine builds them over the worker's KV caches
    ("engine/ranks",),
    ("engine/llm_engine.py", "engine/llm.py"),
    ("engine/serving",),
    ("engine/cli.py", "engine/engine_flags.py", "engine/config_flags.py", "engine/__init__.py"),
)


def _engine_layer(path: str) -> int | None:
    """The index in ``ENGINE_LAYERS`` of an engine file (``engine/core/x.py``), None where no room holds it."""
    for i, rooms in enumerate(ENGINE_LAYERS):
        if any(path == room or path.startswith(room + "/") for room in rooms):
            return i
    return None


def _module_file(module: str) -> str | None:
    """The repository path of a product module name (a package's ``__init__.py``), None if it is not a file here."""
    base = ROOT / module.replace(".", "/")
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return str(candidate.relative_to(ROOT))
    return None


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


def _upward_imports(files: dict[str, set[str]]) -> list[str]:
    """Each import (file -> module) of an engine room from a room ranked above it."""
    upward = []
    for f, mods in files.items():
        mine = _engine_layer(f)
        for m in mods:
            target = _module_file(m) if m == "engine" or m.startswith("engine.") else None
            theirs = None if target is None else _engine_layer(target)
            if mine is not None and theirs is not None and theirs > mine:
                upward.append(f"{f} -> {m} ({ENGINE_LAYERS[mine][0]} imports {ENGINE_LAYERS[theirs][0]})")
    return upward


def _unranked(files: dict[str, set[str]]) -> list[str]:
    """The engine files no room of ``ENGINE_LAYERS`` holds."""
    return [f for f in files if _engine_layer(f) is None]


def test_engine_rooms_import_only_rooms_below_them():
    engine_files = _package_imports()["engine"]
    assert _unranked(engine_files) == [], "place these in a room of ENGINE_LAYERS"
    assert _upward_imports(engine_files) == []


def test_the_layering_check_sees_an_upward_import_and_a_file_in_no_room():
    """Planted: a layer reading the worker, core reading serving, the collectives reading the follower loop above
    them, a model reading the loader, a low room reading the package's lazy names; and a file in a new room that
    no one ranked. Imports down or within a room (the ranks reading the worker, loading reading models) pass."""
    planted = {"engine/layers/attention.py": {"engine.worker.runner", "engine.kernels.attention", "torch"},
               "engine/core/request.py": {"engine.serving.protocol", "engine.text.tokenizer"},
               "engine/distributed/groups.py": {"engine.ranks.follower", "engine.core.config"},
               "engine/models/base.py": {"engine.loading.model_loader", "engine.core.model_config"},
               "engine/processes/process_start.py": {"engine"},
               "engine/ranks/follower.py": {"engine.worker.model_setup", "engine.ranks.engine_ranks"},
               "engine/loading/split_check.py": {"engine.models", "engine.eplb.policy"},
               "engine/new_room/x.py": {"engine.core.config"}}
    assert [u.split(" ")[0] for u in _upward_imports(planted)] == [
        "engine/layers/attention.py", "engine/core/request.py", "engine/distributed/groups.py",
        "engine/models/base.py", "engine/processes/process_start.py"]
    assert _unranked(planted) == ["engine/new_room/x.py"]


def test_the_gateway_process_starts_without_torch():
    """The gateway's process never needs torch (the engine runs in its own process): importing it would add 2-4 s
    and some 300 MB to every gateway start. A module-level import of a torch-using module anywhere under
    ``gateway.app`` or the ``serve`` command brings it in."""
    import subprocess
    import sys

    code = ("import sys, gateway.app, gateway.cli.serve; "
            "print(sorted(m for m in ('torch', 'triton', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
