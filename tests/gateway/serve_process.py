"""Run `moegate serve` as a real process for tests that signal or kill it."""

import asyncio
import collections
import contextlib
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time

import aiohttp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _drain(proc: subprocess.Popen) -> None:
    """Keep reading the server's output (its last lines in ``proc.output_tail``): once the pipe's buffer
    is full, a server that logs (every request does) would block on its next write."""
    proc.output_tail = collections.deque(maxlen=400)
    threading.Thread(target=lambda: proc.output_tail.extend(proc.stdout), daemon=True).start()


def start_server(model: str, db_url: str, port: int, *flags: str, expect_key: bool = True) -> tuple[subprocess.Popen, str | None]:
    """Start the server; with ``expect_key`` (an empty database) read the default tenant's key it prints."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--model", model, "--port", str(port), "--database-url", db_url,
         "--max-num-seqs", "8", "--metrics-port", "0", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    if not expect_key:
        _drain(proc)  # else the pipe fills with access-log lines and the server blocks on its next write
        return proc, None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # printed once, on the first start with an empty database
        line = proc.stdout.readline()
        if not line:
            break
        found = re.search(r"(mg-[A-Za-z0-9_\-]+)", line)
        if found:
            _drain(proc)
            return proc, found.group(1)
    proc.kill()
    raise AssertionError("moegate serve did not print the default tenant's key")


async def wait_ready(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            try:
                async with http.get(f"{url}/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise AssertionError(f"{url} never became ready")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (a graceful drain), then SIGKILL after 30 s."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


@contextlib.contextmanager
def demo_server(prefix: str, *flags: str):
    """`moegate serve` on a fresh random demo model in a temporary folder, ready for requests; yields
    (base URL without /v1, the default tenant's key, the model's folder, the process)."""
    from engine.loading.demo_model import write_demo_model

    tmp = tempfile.mkdtemp(prefix=prefix)
    model = os.path.join(tmp, "demo")
    write_demo_model(model, seed=random.randrange(1000))
    port = free_port()
    proc, key = start_server(model, f"sqlite:///{os.path.join(tmp, 'policy.db')}", port,
                             "--data-dir", os.path.join(tmp, "data"), "--served-model-name", "demo", *flags)
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_ready(url))
        yield url, key, model, proc
    finally:
        stop_server(proc)
