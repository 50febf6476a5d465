"""The adapter reader process returns exactly ``load_adapter``'s factors and refusals, survives its own death, and
ends with its engine; an engine's background reads go through it."""

import os

import pytest
import torch

from engine.lora import reader_process
from engine.lora.peft_format import AdapterFormatError, load_adapter
from engine.lora.reader_process import AdapterReaderProcess
from tests.engine.lora.adapter_dirs import EXPERT_SIZE, EXPERTS, HIDDEN, MALFORMED, write_adapter

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not reader_process.available(), reason="no anonymous shared memory here")]
DIMS = (EXPERTS, HIDDEN, EXPERT_SIZE)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def assert_same_factors(got, want):
    assert got.name == want.name and got.rank == want.rank
    assert got.linears.keys() == want.linears.keys() and got.experts.keys() == want.experts.keys()
    for target, parts in want.linears.items():
        assert got.linears[target].keys() == parts.keys()
        for part, pair in parts.items():
            assert torch.equal(got.linears[target][part].a, pair.a) and torch.equal(got.linears[target][part].b, pair.b)
    for target, pair in want.experts.items():
        assert got.experts[target].a.shape == pair.a.shape  # [E, r, in]
        assert torch.equal(got.experts[target].a, pair.a) and torch.equal(got.experts[target].b, pair.b)


def test_reads_equal_load_adapter_and_survive_the_readers_death(tmp_path):
    reader = AdapterReaderProcess()
    try:
        for k, rank in enumerate((1, 3)):  # random factors each
            path = write_adapter(str(tmp_path / f"ad{k}"), rank=rank)
            assert_same_factors(reader.read(f"ad{k}", path, *DIMS), load_adapter(f"ad{k}", path, *DIMS))
        for case in ("missing_b", "nan_weights", "huge_weights"):  # the child refuses non-finite values too
            config, tensors, after, words = MALFORMED[case]
            bad = write_adapter(str(tmp_path / case), config=config, tensors=tensors)
            with pytest.raises(AdapterFormatError) as here:
                load_adapter(case, bad, *DIMS)
            with pytest.raises(AdapterFormatError) as in_child:
                reader.read(case, bad, *DIMS)
            assert str(in_child.value) == str(here.value) and words in str(here.value)

        child = reader._process  # it yields a busy core to the engine's steps
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == min(
            os.getpriority(os.PRIO_PROCESS, 0) + reader_process.READER_NICENESS, 19)
        child.kill()
        child.wait(timeout=10)
        with pytest.raises(OSError, match="reader process ended"):
            reader.read("ad0", str(tmp_path / "ad0"), *DIMS)
        again = reader.read("ad0", str(tmp_path / "ad0"), *DIMS)  # a new child
        assert reader._process is not child
        assert_same_factors(again, load_adapter("ad0", str(tmp_path / "ad0"), *DIMS))
    finally:
        reader.close()
    assert child.returncode is not None and reader._process is None


def test_factors_outlive_the_reader(tmp_path):
    """The factors are a mapping the engine process owns: valid after the child ended and after the file it read
    was rewritten."""
    path = write_adapter(str(tmp_path / "ad"), rank=2)
    want = load_adapter("ad", path, *DIMS)
    reader = AdapterReaderProcess()
    got = reader.read("ad", path, *DIMS)
    reader.close()
    write_adapter(path, rank=2)  # new random factors in place
    assert_same_factors(got, want)


def test_the_reader_ends_when_its_engine_process_dies(tmp_path):
    """A reader whose starter was killed (no close) sees the socket end and exits."""
    import subprocess
    import sys
    import time

    path = write_adapter(str(tmp_path / "ad"), rank=2)
    script = ("import sys; from engine.lora.reader_process import AdapterReaderProcess\n"
              "r = AdapterReaderProcess(); r.read('ad', sys.argv[1], *map(int, sys.argv[2:]))\n"
              "print(r._process.pid, flush=True); sys.stdin.read()\n")
    starter = subprocess.Popen([sys.executable, "-c", script, path, *map(str, DIMS)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    try:
        child_pid = int(starter.stdout.readline())
        starter.kill()
        starter.wait(timeout=10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and os.path.exists(f"/proc/{child_pid}") and not _zombie(child_pid):
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{child_pid}") or _zombie(child_pid), "the reader outlived its engine"
    finally:
        if starter.poll() is None:
            starter.kill()


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
