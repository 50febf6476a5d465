"""Reading LoRA adapters in a child process, so that parsing one never holds the engine process's GIL.

An adapter read is mostly Python (the safetensors parse, a copy and a reshape per factor, PEFT's fused expert
factors unfolded per expert): run on a thread of the engine process it takes the GIL from the step loop, whose
own Python work then waits; decode steps ran twice as long while a thread read adapters back to back, and
were unchanged while a child process did the same. The child (one per engine rank that reads adapters in the
background, started when the engine has more adapters than host copies, or at its first read) runs
``load_adapter`` and returns the factors in one anonymous shared-memory file (``memfd``) whose descriptor travels
over a socket pair; the engine process maps it and cuts the factors out as views: no copy, and a few
microseconds of Python per factor.

The child is a fresh interpreter (``python -m engine.lora.reader_process FD``), not a multiprocessing child: a
script using ``engine.LLM`` without a ``__main__`` guard would be run again by a multiprocessing start, and
the fresh interpreter's start (importing torch, about 2 s, on another core) is paid once per engine.
It ends when the engine process closes the socket, or dies.

Where anonymous shared memory does not exist (``os.memfd_create`` is Linux's), ``available()`` is False and
the engine reads on a thread as before.
"""

import math
import os
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing import reduction
from multiprocessing.connection import Connection

import torch

from engine.lora.peft_format import AdapterFormatError, ExpertsLora, LinearLora, LoraAdapter, load_adapter

# The child's scheduling niceness (added to the engine's): a background task's share of a busy core.
READER_NICENESS = 10

# One factor pair in the shared file: (kind, target, part, a_offset, a_shape, b_offset, b_shape); offsets in
# float32 elements; kind "linear" (part: its index in a packed target) or "experts" (part unused, 0).
Entry = tuple[str, str, int, int, tuple[int, ...], int, tuple[int, ...]]


def available() -> bool:
    """Whether adapters can be read in a child process here."""
    return hasattr(os, "memfd_create")


class AdapterReaderProcess:
    """A child process that reads adapters on request, one at a time; restarted at the next read if it dies."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one request on the pipe at a time
        self._conn: Connection | None = None
        self._process: subprocess.Popen | None = None

    def read(self, name: str, path: str, num_experts: int | None, hidden_size: int | None,
             expert_size: int | None) -> LoraAdapter:
        """``load_adapter(name, path, ...)`` computed in the child: the same factors (float32, CPU), the same
        AdapterFormatError for an adapter it cannot serve; OSError if the child died during the read."""
        with self._lock:
            conn = self._started()
            try:
                conn.send((name, path, num_experts, hidden_size, expert_size))
                status, payload = conn.recv()
                if status == "error":
                    raise AdapterFormatError(payload)
                rank, numel, entries = payload
                fd = reduction.recv_handle(conn)
            except (EOFError, OSError) as e:  # the child ended: a new one starts at the next read
                self._stop()
                raise OSError(f"the LoRA reader process ended while reading {path} ({type(e).__name__})") from None
        try:
            # [numel] float32, a shared mapping of the child's file (freed when the last factor view goes)
            flat = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=max(numel, 1), dtype=torch.float32)
        finally:
            os.close(fd)
        return _unpack(name, rank, flat, entries)

    def close(self) -> None:
        with self._lock:
            self._stop()

    @property
    def pid(self) -> int | None:
        """The child's process id while it runs (None before its start and after ``close``)."""
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        """Start the child now if it is not running (otherwise its first read does)."""
        with self._lock:
            self._started()

    def _started(self) -> Connection:
        if self._conn is None:
            ours, theirs = socket.socketpair()  # a socket pair: descriptors can travel on it
            # The child imports this package from where this process did (a checkout need not be installed).
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
            with theirs:
                self._process = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())],
                                                 pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
            self._conn = Connection(ours.detach())
        return self._conn

    def _stop(self) -> None:
        if self._conn is not None:
            self._conn.close()  # the child's next recv sees the end and returns
            self._conn = None
        if self._process is not None:
            try:  # it holds nothing to save: one still importing (or mid-read) a second from now is killed
                self._process.wait(timeout=1)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None


def _pack(adapter: LoraAdapter) -> tuple[int, int, list[Entry]]:
    """The adapter's factors copied into a new anonymous shared file: (its descriptor, float32 count, entries)."""
    pairs = [("linear", target, part, pair.a, pair.b) for target, parts in adapter.linears.items()
             for part, pair in parts.items()]
    pairs += [("experts", target, 0, pair.a, pair.b) for target, pair in adapter.experts.items()]
    numel = sum(a.numel() + b.numel() for *_, a, b in pairs)
    fd = os.memfd_create("moegate-lora-adapter")
    os.ftruncate(fd, max(numel, 1) * 4)
    flat = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=max(numel, 1), dtype=torch.float32)  # [numel]
    entries: list[Entry] = []
    offset = 0
    for kind, target, part, a, b in pairs:
        a_offset, b_offset = offset, offset + a.numel()
        flat[a_offset:b_offset].copy_(a.reshape(-1))
        flat[b_offset:b_offset + b.numel()].copy_(b.reshape(-1))
        entries.append((kind, target, part, a_offset, tuple(a.shape), b_offset, tuple(b.shape)))
        offset = b_offset + b.numel()
    return fd, numel, entries


def _unpack(name: str, rank: int, flat: torch.Tensor, entries: list[Entry]) -> LoraAdapter:
    """The adapter whose factors are views of ``flat`` [numel] at ``entries``."""
    def view(offset: int, shape: tuple[int, ...]) -> torch.Tensor:
        return flat[offset:offset + math.prod(shape)].view(shape)

    adapter = LoraAdapter(name, rank)
    for kind, target, part, a_offset, a_shape, b_offset, b_shape in entries:
        a, b = view(a_offset, a_shape), view(b_offset, b_shape)
        if kind == "linear":
            adapter.linears.setdefault(target, {})[part] = LinearLora(a, b)
        else:
            adapter.experts[target] = ExpertsLora(a, b)
    return adapter


def main(argv: list[str]) -> None:
    """The child: read each requested adapter and send it back, until the engine process closes the socket
    (descriptor ``argv[0]``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the engine process, which closes the socket
    torch.set_num_threads(1)  # one read at a time, beside an engine that owns the cores
    # Where the cores are all busy, the engine's steps come first: a read that waits delays only the requests
    # waiting for that adapter, a step that waits delays every request in it.
    os.nice(READER_NICENESS)
    conn = Connection(int(argv[0]))
    while True:
        try:
            name, path, num_experts, hidden_size, expert_size = conn.recv()
        except (EOFError, OSError):
            return
        try:
            adapter = load_adapter(name, path, num_experts, hidden_size, expert_size)
        except AdapterFormatError as e:
            conn.send(("error", str(e)))
            continue
        except Exception as e:  # noqa: BLE001 - the engine process logs it as a failed read
            conn.send(("error", f"adapter at {path}: reading failed ({type(e).__name__}: {e})"))
            continue
        fd, numel, entries = _pack(adapter)
        try:
            conn.send(("ok", (adapter.rank, numel, entries)))
            reduction.send_handle(conn, fd, os.getppid())
        except (EOFError, OSError):
            return
        finally:
            os.close(fd)


if __name__ == "__main__":
    main(sys.argv[1:])
