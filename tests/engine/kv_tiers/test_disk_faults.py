"""The disk tier under faults of its directory: a full disk, the directory deleted while serving, entries that are
not block files, a corrupt file that cannot be deleted, a second engine on the directory, another deployment's
files. Each costs cached blocks (logged, counted), never the engine, and never leaves files the index lacks."""

import builtins
import errno
import logging
import os
import random
import shutil

import pytest
import torch

from engine.kv_tiers import disk_tier
from engine.kv_tiers.block_copier import BlockCopier
from engine.kv_tiers.store import TieredStore

BLOCKS, BLOCK_SIZE = 12, 4


def _store(tmp_path, disk, deployment=None, **kwargs):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    caches = [(torch.randn(BLOCKS + 1, BLOCK_SIZE, 2, 3, generator=gen),)]
    copier = BlockCopier(caches, torch.device("cpu"))
    extra = {} if deployment is None else {"deployment": deployment}
    return TieredStore(copier, b"f" * 16, 8 * copier.block_bytes, str(disk), 64 * copier.block_bytes, **extra,
                       **kwargs)


def _save(store, blocks, tenant="acme"):
    store.save(store.reserve([(i, bytes([i + 1]) * 16, tenant) for i in blocks]))
    store.flush()


def _files(disk, suffix=".kvb"):
    return sorted(n for n in os.listdir(disk) if n.endswith(suffix))


def _indexed_files(store):
    return sorted(os.path.basename(e.handle) for e in store.disk.index.entries.values())


def test_a_full_disk_leaves_nothing_and_is_logged_and_counted(tmp_path, monkeypatch, caplog):
    disk = tmp_path / "d"
    store = _store(tmp_path, disk)
    real_open = builtins.open

    class FullDisk:
        """A file on a disk with room for 10 bytes: the rest of a write fails with ENOSPC."""

        def __init__(self, path):
            self.f = real_open(path, "wb")

        def write(self, data):
            self.f.write(bytes(data[:10]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def full_open(path, mode="r", *args, **kwargs):
        if "w" in mode and str(path).startswith(str(disk)) and str(path).endswith(".tmp"):
            return FullDisk(path)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(disk_tier, "open", full_open, raising=False)
    with caplog.at_level(logging.WARNING, logger="engine.kv_tiers"):
        _save(store, range(4))
    assert _files(disk) == [] and _files(disk, ".tmp") == [] and len(store.disk.index) == 0
    assert store.counters.get("disk", "acme", "write_errors") == 4
    assert store.counters.get("disk", "acme", "bytes_in") == 0
    assert any("writes failed" in r.getMessage() and "No space left" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()  # room again: the next writes land, each indexed
    _save(store, range(4, 7))
    assert _files(disk) == _indexed_files(store) and len(_files(disk)) == 3
    store.close()


def test_a_deleted_directory_is_logged_once_and_recreated(tmp_path, caplog):
    disk = tmp_path / "d"
    store = _store(tmp_path, disk)
    _save(store, range(3))
    assert len(_files(disk)) == 3
    shutil.rmtree(disk)
    with caplog.at_level(logging.WARNING, logger="engine.kv_tiers"):
        for i in range(3, 7):
            _save(store, [i])
    vanished = [r for r in caplog.records if "vanished" in r.getMessage()]
    assert len(vanished) == 1 and vanished[0].levelno == logging.ERROR
    # Blocks written since are on disk and indexed; the lost ones are misses, not errors.
    assert _files(disk) == _indexed_files(store) and len(_files(disk)) >= 3
    assert store.disk.read(store.key(bytes([1]) * 16)) is None
    store.close()


def test_odd_entries_and_an_undeletable_corrupt_file_are_skipped(tmp_path, monkeypatch, caplog):
    disk = tmp_path / "d"
    store = _store(tmp_path, disk)
    _save(store, range(2))
    kept = _files(disk)
    store.close()
    (disk / ("ab" * 32 + ".kvb")).mkdir()  # a directory named like a block file
    (disk / "x.kvb").mkdir()
    corrupt = disk / ("cd" * 32 + ".kvb")
    corrupt.write_bytes(b"not a block")
    real_unlink = os.unlink

    def read_only_unlink(path, *args, **kwargs):  # as in a read-only directory (root would be let through)
        if str(path).startswith(str(disk)):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", read_only_unlink)
    with caplog.at_level(logging.WARNING, logger="engine.kv_tiers"):
        again = _store(tmp_path, disk)  # starts
    monkeypatch.undo()
    assert _indexed_files(again) == kept and corrupt.exists()
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "x.kvb is not a regular file" in warned and f"cannot delete {corrupt.name}" in warned
    again.close()


def test_a_second_engine_on_the_directory_is_refused_with_one_line(tmp_path):
    disk = tmp_path / "d"
    first = _store(tmp_path, disk)
    with pytest.raises(ValueError) as e:
        _store(tmp_path, disk)
    message = str(e.value)
    assert "\n" not in message and "--disk-cache-dir" in message and str(disk) in message
    assert str(os.getpid()) in message
    first.close()
    _store(tmp_path, disk).close()  # free again once the first has stopped


def test_files_of_another_deployment_are_removed_at_start(tmp_path):
    disk = tmp_path / "d"
    store = _store(tmp_path, disk, deployment="a" * 64)
    _save(store, range(3))
    store.close()
    same = _store(tmp_path, disk, deployment="a" * 64)  # a restart of the same deployment keeps them
    assert len(same.disk.index) == 3
    same.close()
    other = _store(tmp_path, disk, deployment="b" * 64)
    assert len(other.disk.index) == 0 and _files(disk) == []
    _save(other, [5])
    other.close()
    assert len(_files(disk)) == 1
