"""How moegate starts engine processes and follower ranks: forked from a server that imported torch and the engine once.

A fresh interpreter spends 3-4 s of CPU importing torch, transformers, Triton and the engine before an engine
process or a rank does anything of its own; a gateway starts one engine process per replica, again after every
crash, an engine server one per gateway, and an engine split over ranks one process per follower rank on its
node (``engine.ranks.engine_ranks``). Python's multiprocessing forkserver imports ``PRELOAD`` (and the extra
modules the first start asked for: ``process_context``) once, in a server process of its own started at the first
start, and forks each process from it. The server only imports:
nothing in ``PRELOAD`` computes, starts a thread pool or touches a GPU (CUDA is initialised lazily, in the
started process, after its ``CUDA_VISIBLE_DEVICES`` is set), so a forked process starts as clean as a spawned
one, in a few milliseconds.

What a forked process does not get from the server is the starting process's environment at the moment of the
start (the server has its own, from when it started): ``start_process`` passes it, with the overrides, and the
new process takes it before anything else runs. Variables read at import time (``TRITON_INTERPRET``, which
decides whether Triton kernels are compiled or interpreted) are the ones set when the first process started.

``MOEGATE_PROCESS_START=spawn`` starts every process in a fresh interpreter instead.

Neither runs the starting program's main module again: multiprocessing would, in every started process (to find
what the target names there), so a script that builds ``engine.LLM(..., tensor_parallel_size=2)`` at top level,
without an ``if __name__ == "__main__":`` guard, would build it again in each rank, which starts ranks in turn.
The targets started here are moegate's own functions, so the main module is hidden from multiprocessing while a
process starts (``_main_module_hidden``) and the started process never imports it.
"""

import contextlib
import importlib
import multiprocessing
import os
import sys
import threading
import types
from collections.abc import Callable
from multiprocessing.process import BaseProcess

START_METHOD_ENV = "MOEGATE_PROCESS_START"
START_METHODS = ("forkserver", "spawn")
# Imported once by the forkserver; what an engine process, or a follower rank, needs before its first step. The
# last two are imported lazily by every model build (reading ``config.json`` through ``AutoConfig``, which scans
# transformers' model packages; ``Module.to_empty``, which imports sympy through torch's symbolic shapes): about
# 1 s of CPU in each started process, once in the server instead.
PRELOAD = ("torch", "engine.llm_engine", "engine.serving.engine_process", "engine.ranks.follower",
           "transformers.models.auto.configuration_auto", "torch.fx.experimental.symbolic_shapes")


def process_context(preload: tuple[str, ...] = ()) -> multiprocessing.context.BaseContext:
    """The multiprocessing context processes start from (``MOEGATE_PROCESS_START``, default forkserver).

    ``preload``: modules the forkserver imports besides ``PRELOAD`` (what the started processes import anyway,
    a test's modules, say; like ``PRELOAD``'s, importing them must do nothing else). There is one forkserver per
    process and its imports are the ones asked for by the call before the start that started it (the first
    start): a later call asking for other modules changes nothing for the running server, and the processes it
    starts import those themselves (slower, the same otherwise)."""
    method = os.environ.get(START_METHOD_ENV) or "forkserver"
    if method not in START_METHODS:
        raise ValueError(f"{START_METHOD_ENV} must be one of {', '.join(START_METHODS)}, got {method!r}")
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(dict.fromkeys((*PRELOAD, *preload))))  # read when the server starts
    return ctx


_MAIN_SWAP = threading.Lock()  # one start at a time swaps the main module out and back


@contextlib.contextmanager
def _main_module_hidden():
    """While a process starts: ``__main__`` is an empty module, so multiprocessing's preparation data names no
    main module to run again in the new process (see the module docstring)."""
    with _MAIN_SWAP:
        main = sys.modules.get("__main__")
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            yield
        finally:
            sys.modules["__main__"] = main


def _in_environment(environ: dict[str, str], target: Callable, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environ)
    target(*args)


def start_process(target: Callable, args: tuple, name: str, env: dict[str, str] | None = None,
                  preload: tuple[str, ...] = ()) -> BaseProcess:
    """Start ``target(*args)`` in a new daemon process with this process's environment plus ``env`` (see the
    module docstring); ``target`` and ``args`` must be picklable (connections are: they travel as descriptors).
    ``preload``: as ``process_context``'s (effective only if this start starts the forkserver)."""
    environ = {**os.environ, **(env or {})}
    current = multiprocessing.current_process()
    if current.daemon:  # an engine process starting its ranks: multiprocessing refuses children to a daemonic
        current.daemon = False  # process, a flag that only says its starter ends it at exit (and so it ends them)
    process = process_context(preload).Process(target=_in_environment, args=(environ, target, args), name=name,
                                               daemon=True)
    with _main_module_hidden():
        process.start()
    return process


def run_main(module: str, argv: list[str]) -> None:
    """A ``start_process`` target: ``module``'s ``main(argv)``, its return value the exit code (named, not
    imported here, so that a module can start processes running a module that imports it)."""
    sys.exit(importlib.import_module(module).main(argv))
