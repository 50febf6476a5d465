"""Static audit of the step's hot path for calls that make the host wait for the GPU.

On CUDA ``test_cuda_graphs.test_forward_has_no_host_sync`` checks the real thing with
``torch.cuda.set_sync_debug_mode("error")``; this test runs everywhere and names the
line: a read-back (.item(), .tolist(), .cpu(), .numpy()), an op whose output size
is data-dependent (nonzero, unique, bincount, masked_select) or a host list copied
to the device synchronously (torch.tensor(..., device=...)).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
HOT_PATH = [
    *sorted((ROOT / "engine/layers").glob("*.py")),
    *sorted((ROOT / "engine/models").glob("*.py")),
    ROOT / "engine/worker/runner.py",
    ROOT / "engine/worker/batch_builder.py",
    ROOT / "engine/device_batch/staging.py",
    ROOT / "engine/transforms/cuda_graphs.py",
    ROOT / "engine/sampling/sampler.py",
    ROOT / "engine/worker/overlap.py",
    ROOT / "engine/sampling/prompt_scoring.py",
    ROOT / "engine/eplb/expert_load.py",
    *sorted((ROOT / "engine/sampling").glob("*.py")),
    ROOT / "engine/structured_output/matchers.py",
    ROOT / "moe_kernels/routing.py",
    ROOT / "moe_kernels/align.py",
    ROOT / "moe_kernels/dispatch.py",
    ROOT / "moe_kernels/triton_backend.py",
]
SYNCING_METHODS = {"item", "tolist", "cpu", "numpy", "nonzero", "unique", "bincount", "masked_select"}
# (file, function): the justified ones.
ALLOWED = {
    ("engine/sampling/sampler.py", "__call__"),  # reading the sampled tokens: the step's one sync
    ("engine/sampling/prompt_scoring.py", "read"),  # prompt logprobs of a synchronous step, read after that sync
    ("engine/eplb/expert_load.py", "poll"),  # pinned host memory a finished copy filled; the CPU's own counters
    ("engine/worker/overlap.py", "collect"),  # overlapped steps: reading a step's results, one step late
    # Expert parallel with LoRA adapters: the adapter slots that came with other ranks' tokens are read back to
    # lay out their deltas, one read per layer beside the dispatch's own (its all-to-all split sizes).
    ("engine/layers/moe.py", "_local_experts"),
    # DeepSeek-V4's torch path (eager only: no CUDA graphs for the family yet): its clamped experts loop over the
    # experts the step's tokens chose, and its compressed attention reads each request's context length and first
    # position to slice the request's rows and windows. Both go when the family gets its kernels.
    ("engine/layers/clamped_moe.py", "forward"),
    ("engine/layers/compressed_attention.py", "_requests"),
    ("engine/layers/compressed_attention.py", "forward"),
    # Hidden KV slots found with nonzero only where the tensors are on the CPU (nothing to wait for); on a GPU the
    # same function masks them without a read-back.
    ("engine/layers/paged_attention.py", "gather_visible"),
    ("engine/layers/selected_rows.py", "gather_selected_rows"),  # the same for a sparse selection's padded slots
}


def _findings(path: Path, rel: str | None = None) -> list[str]:
    rel = rel or str(path.relative_to(ROOT))
    tree = ast.parse(path.read_text())
    found = []

    def visit(node: ast.AST, func: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            func = node.name
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = node.func.attr
            sync_copy = (name == "tensor" and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                         and any(k.arg == "device" for k in node.keywords))
            if (name in SYNCING_METHODS or sync_copy) and (rel, func) not in ALLOWED:
                found.append(f"{rel}:{node.lineno} {func}(): .{name}(")
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(tree, "<module>")
    return found


def test_hot_path_has_no_unjustified_host_sync():
    findings = [f for path in HOT_PATH for f in _findings(path)]
    assert not findings, "host syncs in the step's hot path:\n" + "\n".join(findings)


def test_the_audit_sees_a_sync(tmp_path):
    # The audit itself: planted syncs are found, the allowed function is not reported.
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\ndef f(x):\n    return x.sum().item()\n"
                     "def g(d):\n    return torch.tensor([1], device=d)\n"
                     "def poll(x):\n    return x.tolist()\n")
    assert _findings(probe, "m.py") == ["m.py:3 f(): .item(", "m.py:5 g(): .tensor(", "m.py:7 poll(): .tolist("]
    assert _findings(probe, "engine/eplb/expert_load.py") == ["engine/eplb/expert_load.py:3 f(): .item(",
                                                             "engine/eplb/expert_load.py:5 g(): .tensor("]
