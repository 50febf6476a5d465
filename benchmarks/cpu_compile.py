"""Eager vs ``torch.compile`` (inductor, C++ codegen) for the engine's forward on the CPU, side by side.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.cpu_compile \
        --variants pieces,pieces-freeze,pieces-freeze-autotune,whole --e2e-variants pieces,pieces-freeze \
        --rounds 7 --e2e-rounds 4 --breakdown

Builds the small model of ``benchmarks.offline_vs_transformers`` (random weights, float32) in one engine,
runs its offline workload once eagerly while recording a decode-only step (all requests decoding) and the
first prefill step, then:

1. Step timings: each variant's forward + LM head on the recorded steps, the variants alternating
   round by round in this process; per-step median ms and the ratio to eager. The first calls of a
   variant (the compile) are timed apart, as compile seconds.
2. Equality: max |logits - eager logits| on each recorded step, and greedy tokens of a few steps.
3. End to end (``--e2e-rounds`` > 0): the whole offline workload through the engine with the variant
   installed, against eager, alternating; output tokens/s and whether every output equals eager's.

Variants (each installs itself on the built engine by patching instances; no engine code changes):

- ``whole``: ``torch.compile(model, dynamic=True)`` (the paged-attention Python loop traced too) and
  the LM head compiled.
- ``pieces``: per decoder layer, ``pre_attention`` (input norm, qkv projection, q/k norms, RoPE) and
  ``post_attention`` (o_proj, norm, MoE block: router, routing, the routed experts, shared-expert
  add) compiled with ``dynamic=True``, the paged-attention core eager between them; the LM head
  compiled.

In every compiled variant the routed experts (``moe_kernels.fused_moe``) are one opaque custom op
running the eager grouped matmuls: see ``_opaque_fused_moe`` for why.
- ``-freeze`` suffix: ``freezing=True`` (weights as constants: inductor prepacks the dense linears for
  oneDNN, ``cpp.weight_prepack`` left on). Turning ``cpp.weight_prepack`` off is not offered: inductor
  reads it once per process, when its freezing patterns are first registered, so it cannot be compared
  side by side in one process.
- ``-autotune`` suffix: ``max_autotune`` on (what ``mode="max-autotune-no-cudagraphs"`` sets on a CPU):
  inductor times its C++ GEMM templates against the library matmul for each linear and keeps the faster.
  Check the log for its "AUTOTUNE" reports: in this process, beside the other variants, torch 2.13
  benchmarked the templates in some runs and in others none at all (the variant is then a second
  copy of ``pieces-freeze``).

The engine runs with prefix caching off so that repeated runs of the same prompts redo the same work
(the prompts are random tokens: they share no prefix, so a fresh engine would find no hits either).
"""

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch._inductor.config as inductor_config

import moe_kernels
from benchmarks.offline_vs_transformers import SHAPES, _write_model
from engine.worker.cpu_allocator import keep_freed_memory
from loadgen import offline


_eager_fused_moe = moe_kernels.fused_moe


class Timers:
    """Wall ms per part of the forward (the CPU runs each op to completion: no syncs needed)."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}

    def timed(self, key: str, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ms[key] = self.ms.get(key, 0.0) + (time.perf_counter() - start) * 1e3
        return run


_TIMERS: Timers | None = None  # set while a breakdown runs


# torch 2.13's fake-tensor (meta) rule for ``torch._grouped_mm`` mirrors the CUDA kernel and refuses float32
# ("Expected inputs of BF16 type"), though the CPU op takes it: dynamo cannot trace the grouped expert path.
# The compiled variants therefore see the routed experts as one opaque op (the same eager C++ inside).
@torch.library.custom_op("moegate_bench::fused_moe", mutates_args=())
def _opaque_fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> torch.Tensor:
    if _TIMERS is not None:
        return _TIMERS.timed("experts", _eager_fused_moe)(x, w13, w2, topk_weights, topk_ids, backend="torch")
    return _eager_fused_moe(x, w13, w2, topk_weights, topk_ids, backend="torch")


@_opaque_fused_moe.register_fake
def _(x, w13, w2, topk_weights, topk_ids):
    return torch.empty_like(x)


def _fused_moe_for_compile(x, w13, w2, topk_weights, topk_ids, backend="auto", activation="silu", **scales):
    if scales or activation != "silu" or backend not in ("auto", "torch"):
        return _eager_fused_moe(x, w13, w2, topk_weights, topk_ids, backend=backend, activation=activation, **scales)
    return _opaque_fused_moe(x, w13, w2, topk_weights, topk_ids)


@dataclass
class Variant:
    name: str
    compile_s: float = 0.0  # first calls on the recorded steps
    e2e_first_s: float | None = None  # first end-to-end run (with whatever recompiles it needs)
    step_ms: dict[str, list[float]] = field(default_factory=dict)
    max_diff: dict[str, float] = field(default_factory=dict)
    same_argmax: dict[str, float] = field(default_factory=dict)
    e2e: list[float] = field(default_factory=list)  # seconds
    e2e_same: list[float] = field(default_factory=list)  # fraction of outputs equal to eager's
    recompiles: int = 0  # dynamo graphs compiled for the recorded steps
    e2e_graphs: int = 0  # more graphs compiled during the first end-to-end run (other batch shapes)


def _inductor_config(name: str) -> dict:
    """Inductor settings of a variant. Set globally while the variant is installed (its compiles happen on
    its first calls): in torch 2.13 ``torch.compile(options={"freezing": True})`` leaves the weights
    unfrozen and unpacked; only the global ``torch._inductor.config.freezing`` packs them."""
    return {"freezing": "-freeze" in name, "max_autotune": "-autotune" in name}


class Installer:
    """Patches a variant onto the engine's model and runner instances, and takes it off again."""

    def __init__(self, llm) -> None:
        self.runner = llm.engine.runner
        self.model = self.runner.model
        self.compiled: dict[str, dict] = {}  # variant -> {attribute path: compiled callable}

    def _build(self, name: str) -> dict:
        if name in self.compiled:
            return self.compiled[name]

        wrappers: dict = {}

        def comp(method: str, owner):
            # Dynamo keeps its compiled graphs on the code object it is handed, whatever the torch.compile
            # call: a fresh wrapper per variant (shared by the layers) keeps each variant's graphs its own.
            if method not in wrappers:
                ns: dict = {}
                exec(f"def {method}_{name.replace('-', '_')}(owner, *args):\n"
                     f"    return type(owner).{method}(owner, *args)\n", ns)
                wrappers[method] = torch.compile(ns.popitem()[1], dynamic=True)
            compiled = wrappers[method]
            return lambda *args: compiled(owner, *args)

        parts: dict = {}
        model = self.model
        if name.startswith("whole"):
            whole = comp("forward", model)
            parts[("runner", "forward")] = lambda batch: whole(batch.input_ids, batch.positions, batch.meta)
        elif name.startswith("pieces"):
            for i, layer in enumerate(model.model.layers):
                parts[(f"layer{i}", "pre_attention")] = comp("pre_attention", layer)
                parts[(f"layer{i}", "post_attention")] = comp("post_attention", layer)
        else:
            raise ValueError(name)
        parts[("model", "compute_logits")] = comp("compute_logits", model)
        self.compiled[name] = parts
        return parts

    def _target(self, key: str):
        if key == "runner":
            return self.runner
        if key == "model":
            return self.model
        return self.model.model.layers[int(key.removeprefix("layer"))]

    def install(self, name: str) -> None:
        if name == "eager":
            return
        moe_kernels.fused_moe = _fused_moe_for_compile
        self._saved = _set_inductor(_inductor_config(name))
        for (owner, attr), fn in self._build(name).items():
            setattr(self._target(owner), attr, fn)

    def uninstall(self, name: str) -> None:
        if name == "eager":
            return
        moe_kernels.fused_moe = _eager_fused_moe
        _set_inductor(self._saved)
        for owner, attr in self._build(name):
            delattr(self._target(owner), attr)


def _set_inductor(values: dict) -> dict:
    """Set inductor config entries ("cpp.weight_prepack" style keys); returns their previous values."""
    previous = {}
    for key, value in values.items():
        owner, _, attr = key.rpartition(".")
        section = getattr(inductor_config, owner) if owner else inductor_config
        previous[key] = getattr(section, attr)
        setattr(section, attr, value)
    return previous


def _record_steps(llm, reqs) -> tuple[dict, list, float]:
    """Run the workload eagerly, keeping the first prefill batch and the first decode-only batch with every
    request decoding. Returns ({"decode": batch, "prefill": batch}, outputs, seconds)."""
    runner = llm.engine.runner
    recorded: dict = {}
    eager_forward = runner.forward

    def recording(batch):
        t = batch.input_ids.shape[0]
        if "prefill" not in recorded and batch.num_decodes == 0:
            recorded["prefill"] = batch
        if "decode" not in recorded and batch.num_decodes == t == len(reqs):
            recorded["decode"] = batch
        return eager_forward(batch)

    runner.forward = recording
    try:
        outs, seconds = _generate(llm, reqs)
    finally:
        del runner.forward
    return recorded, outs, seconds


def _generate(llm, reqs):
    from engine import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    start = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params)
    seconds = time.perf_counter() - start
    return [list(o.token_ids) for o in outs], seconds


@torch.inference_mode()
def _step(runner, batch) -> torch.Tensor:
    hidden = runner.forward(batch)
    return runner.model.compute_logits(hidden.index_select(0, batch.sample_rows))


def _time_step(runner, batch, iters: int) -> float:
    """Median ms of ``iters`` calls."""
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        _step(runner, batch)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _greedy_steps(runner, batch, n: int) -> list[list[int]]:
    """Greedy tokens of ``n`` decode steps starting from ``batch``: step i feeds step i-1's tokens at the
    same slots (the recorded step's positions and slots, replayed: same shapes, new inputs)."""
    tokens = []
    ids = batch.input_ids
    for _ in range(n):
        b = type(batch)(**{f: getattr(batch, f) for f in batch.__dataclass_fields__})
        b.input_ids = ids
        nxt = _step(runner, b).argmax(-1)
        tokens.append(nxt.tolist())
        ids = nxt.to(torch.int64)
    return tokens


def _compile_count() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="pieces,pieces-freeze,whole",
                   help="comma-separated: whole, pieces, each optionally -freeze, -freeze-autotune")
    p.add_argument("--rounds", type=int, default=5, help="step-timing rounds (variants alternate in each)")
    p.add_argument("--iters", type=int, default=10, help="decode steps timed per round and variant")
    p.add_argument("--prefill-iters", type=int, default=2, help="prefill steps timed per round and variant")
    p.add_argument("--greedy-steps", type=int, default=4)
    p.add_argument("--e2e-rounds", type=int, default=0, help="whole offline runs per variant (alternating with eager)")
    p.add_argument("--e2e-variants", default=None, help="variants run end to end (default: all of --variants)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--breakdown", action="store_true", help="time each part of the decode step per variant")
    args = p.parse_args()
    names = ["eager"] + [v for v in args.variants.split(",") if v]
    e2e_names = ["eager"] + [v for v in (args.e2e_variants or args.variants).split(",") if v]
    keep_freed_memory()
    torch._dynamo.config.recompile_limit = 64  # count recompiles rather than fall back to eager silently
    print(f"torch {torch.__version__}, threads: {torch.get_num_threads()}", flush=True)
    from engine import LLM

    overrides, num_requests, prompts, outputs = SHAPES["small"]
    with tempfile.TemporaryDirectory(prefix="moegate-compile-") as root:
        # Compile seconds are cold: inductor's on-disk caches start empty (unless the caller set the folder).
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(root, "inductor-cache"))
        _write_model(os.path.join(root, "model"), overrides, args.seed)
        vocab = offline.BENCH_MODEL_CONFIG["vocab_size"]
        reqs = offline.make_workload(num_requests, args.seed, vocab, prompts, outputs)
        llm = LLM(model=os.path.join(root, "model"), dtype="float32", device="cpu", max_num_seqs=128,
                  max_num_batched_tokens=2048, enable_prefix_caching=False)
        recorded, eager_outs, eager_s = _record_steps(llm, reqs)
        print(f"eager warm-up run: {eager_s:.2f} s; recorded steps: "
              + ", ".join(f"{k} T={b.input_ids.shape[0]}" for k, b in recorded.items()), flush=True)
        runner = llm.engine.runner
        inst = Installer(llm)
        variants = {n: Variant(n) for n in names}

        # Reference logits and greedy tokens.
        ref = {k: _step(runner, recorded[k]) for k in ("decode", "prefill")}
        ref_greedy = _greedy_steps(runner, recorded["decode"], args.greedy_steps)

        # Compile: first calls on each recorded step.
        for n in names[1:]:
            v = variants[n]
            before = _compile_count()
            inst.install(n)
            try:
                start = time.perf_counter()
                for k in ("decode", "prefill"):
                    b = recorded[k]
                    out = _step(runner, b)
                    v.max_diff[k] = (out - ref[k]).abs().max().item()
                    v.same_argmax[k] = (out.argmax(-1) == ref[k].argmax(-1)).float().mean().item()
                _step(runner, recorded["decode"])
                v.compile_s = time.perf_counter() - start
                greedy = _greedy_steps(runner, recorded["decode"], args.greedy_steps)
                v.same_argmax["greedy"] = sum(a == b for g, r in zip(greedy, ref_greedy) for a, b in zip(g, r)) / sum(
                    len(r) for r in ref_greedy)
            finally:
                inst.uninstall(n)
            v.recompiles = _compile_count() - before
            print(f"{n}: compiled in {v.compile_s:.1f} s ({v.recompiles} graphs), max |dlogits| "
                  + ", ".join(f"{k} {d:.2e}" for k, d in v.max_diff.items())
                  + f", greedy tokens equal {v.same_argmax['greedy']:.0%}", flush=True)

        # Step timings, alternating.
        for rnd in range(args.rounds):
            for n in names:
                inst.install(n)
                try:
                    v = variants[n]
                    v.step_ms.setdefault("decode", []).append(_time_step(runner, recorded["decode"], args.iters))
                    if args.prefill_iters:
                        v.step_ms.setdefault("prefill", []).append(
                            _time_step(runner, recorded["prefill"], args.prefill_iters))
                finally:
                    inst.uninstall(n)
            print(f"round {rnd}: " + ", ".join(
                f"{n} {variants[n].step_ms['decode'][-1]:.2f}" for n in names) + " ms/decode step", flush=True)

        if args.breakdown:
            # The whole-model variant traces the layers inline: its parts cannot be timed apart.
            _breakdown(runner, inst, [n for n in names if not n.startswith("whole")], recorded["decode"], args.iters,
                       args.rounds)

        # End to end, alternating.
        for rnd in range(args.e2e_rounds):
            for n in e2e_names:
                v = variants[n]
                before = _compile_count()
                inst.install(n)
                try:
                    outs, seconds = _generate(llm, reqs)
                finally:
                    inst.uninstall(n)
                if rnd == 0 and n != "eager":
                    v.e2e_first_s = seconds
                    v.e2e_graphs = _compile_count() - before
                    if args.e2e_rounds > 1:
                        continue  # the first run pays for recompiles: timed apart
                v.e2e.append(seconds)
                v.e2e_same.append(sum(o == e for o, e in zip(outs, eager_outs)) / len(outs))
                print(f"e2e round {rnd} {n}: {seconds:.2f} s, outputs equal to eager {v.e2e_same[-1]:.0%}", flush=True)

        tokens = sum(r.max_tokens for r in reqs)
        _report(variants, names, e2e_names, tokens)


def _breakdown(runner, inst, names, batch, iters: int, rounds: int) -> None:
    """Per-part ms of the recorded decode step, each variant timed with wrappers around its parts (the
    routed experts timed inside: eager for every variant); the variants alternate, ``rounds`` times."""
    global _TIMERS
    model = runner.model
    parts = {n: [] for n in names}
    for _ in range(rounds):
        for n in names:
            inst.install(n)
            timers = Timers()
            patched = []
            try:
                for layer in model.model.layers:
                    for owner, attr, key in ((layer, "pre_attention", "pre_attention"),
                                             (layer.self_attn, "attend", "attention"),
                                             (layer, "post_attention", "post_attention")):
                        patched.append((owner, attr, owner.__dict__.get(attr)))
                        setattr(owner, attr, timers.timed(key, getattr(owner, attr)))
                patched.append((model, "compute_logits", model.__dict__.get("compute_logits")))
                model.compute_logits = timers.timed("lm_head", model.compute_logits)
                if n == "eager":
                    moe_kernels.fused_moe = timers.timed("experts", _eager_fused_moe)
                _TIMERS = timers
                _step(runner, batch)  # warm
                timers.ms.clear()
                total = 0.0
                for _ in range(iters):
                    start = time.perf_counter()
                    _step(runner, batch)
                    total += (time.perf_counter() - start) * 1e3
                timers.ms["step"] = total
            finally:
                _TIMERS = None
                moe_kernels.fused_moe = _eager_fused_moe
                for owner, attr, previous in reversed(patched):
                    if previous is None:
                        delattr(owner, attr)
                    else:
                        setattr(owner, attr, previous)
                inst.uninstall(n)
            parts[n].append({k: v / iters for k, v in timers.ms.items()})
    keys = ["step", "pre_attention", "attention", "post_attention", "experts", "lm_head"]
    print()
    print("decode step (T=64) by part, ms (median of rounds); post_attention includes the routed experts")
    print("| variant | " + " | ".join(keys) + " | rest |")
    print("|---|" + "---:|" * (len(keys) + 1))
    for n in names:
        med = {k: statistics.median(r.get(k, 0.0) for r in parts[n]) for k in keys}
        rest = med["step"] - med["pre_attention"] - med["attention"] - med["post_attention"] - med["lm_head"]
        print(f"| {n} | " + " | ".join(f"{med[k]:.2f}" for k in keys) + f" | {rest:.2f} |")


def _report(variants, names, e2e_names, tokens) -> None:
    eager = variants["eager"]
    med = {n: {k: statistics.median(t) for k, t in variants[n].step_ms.items()} for n in names}
    print()
    print("| variant | decode step ms (T=64) | vs eager | prefill step ms | vs eager | compile s | graphs "
          "| max abs dlogits (decode / prefill) | greedy tokens equal |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in names:
        v, m = variants[n], med[n]
        pre = m.get("prefill")
        pre_s = f"{pre:.1f} | {med['eager']['prefill'] / pre:.2f}x" if pre else "- | -"
        diff = " / ".join(f"{v.max_diff[k]:.1e}" for k in ("decode", "prefill") if k in v.max_diff) or "-"
        same = f"{v.same_argmax['greedy']:.0%}" if "greedy" in v.same_argmax else "-"
        comp = f"{v.compile_s:.1f}" if n != "eager" else "-"
        print(f"| {n} | {m['decode']:.2f} | {med['eager']['decode'] / m['decode']:.2f}x | {pre_s} | {comp} | "
              f"{v.recompiles if n != 'eager' else '-'} | {diff} | {same} |")
    if eager.e2e:
        print()
        print("| variant | end-to-end s (median) | output tok/s | vs eager | first run s (its new graphs) "
              "| outputs equal |")
        print("|---|---:|---:|---:|---:|---:|")
        for n in e2e_names:
            v = variants[n]
            if not v.e2e:
                continue
            s = statistics.median(v.e2e)
            first = f"{v.e2e_first_s:.1f} ({v.e2e_graphs})" if v.e2e_first_s is not None else "-"
            print(f"| {n} | {s:.2f} | {tokens / s:.1f} | {statistics.median(eager.e2e) / s:.2f}x | {first} | "
                  f"{min(v.e2e_same):.0%} |")


if __name__ == "__main__":
    main()
