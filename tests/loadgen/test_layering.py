"""loadgen stands apart: it speaks HTTP and may import the engine (offline modes), never gateway or tenants."""

import ast
import pathlib

import loadgen


def test_loadgen_imports_neither_gateway_nor_tenants():
    root = pathlib.Path(loadgen.__file__).parent
    bad = []
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("gateway", "tenants")]
    assert len(list(root.glob("*.py"))) >= 10 and bad == []
