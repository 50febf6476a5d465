"""The disk tier: one file per block under a directory, surviving engine restarts.

File ``<key hex>.kvb``: a header, then the block's bytes.

    magic  8 bytes  b"MGKVBLK1"
    key    32 bytes the tier key (must match the file name)
    tlen   2 bytes  little-endian length of the tenant name
    tenant tlen bytes (UTF-8; for share accounting after a restart)
    plen   8 bytes  little-endian payload length
    sum    16 bytes BLAKE2b of the payload
    payload

A file is written under a temporary name and renamed, so a crash never leaves a half-written block under
its real name. A file whose header, length or checksum does not match is a miss and is deleted, never served.

Faults of the directory are logged and cost cached blocks, never the engine: a write that fails (a full disk,
say) leaves no file and no index entry and is counted (``num_write_errors``); a directory deleted while the
engine runs is logged once and recreated where possible; an entry that is not a regular file, or a corrupt one
that cannot be deleted (a read-only directory), is skipped with a warning. Who may use the directory (one
engine at a time, files of this deployment only) is ``engine.kv_tiers.disk_dir``'s.
"""

import errno
import hashlib
import logging
import os
import stat
import struct
import threading
import time
from typing import NamedTuple

from engine.kv_tiers.disk_dir import LOCK_FILE, NO_DEPLOYMENT, DiskCacheBusy, lock_directory, owner_of, record_owner
from engine.kv_tiers.keys import KEY_BYTES
from engine.core.lru_index import Entry, LruIndex

logger = logging.getLogger(__name__)

MAGIC = b"MGKVBLK1"
SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
LOG_EVERY_S = 60.0  # write failures are logged at most this often (with how many there were since)


def _header(key: bytes, tenant: str, payload: bytes | memoryview) -> bytes:
    name = tenant.encode()
    return (MAGIC + key + struct.pack("<H", len(name)) + name + struct.pack("<Q", len(payload))
            + hashlib.blake2b(payload, digest_size=16).digest())


class Written(NamedTuple):
    """What one ``DiskTier.write`` did: the entries evicted for it, whether the block is now on disk, and whether
    the write failed (it then left nothing behind)."""

    evicted: list[tuple[bytes, Entry]]
    stored: bool
    failed: bool = False


class DiskTier:
    """Size-bounded LRU of block files. Thread-safe: the engine's writer thread stores, the scheduler reads.

    ``deployment``: whose files the directory may hold (``EngineConfig.deployment_id``); files written under
    another are deleted at start. DiskCacheBusy if another engine uses the directory."""

    name = "disk"

    def __init__(self, directory: str, capacity_bytes: int, block_bytes: int, deployment: str | None = None,
                 eviction_policy: str = "lru", classes: dict[str, int] | None = None) -> None:
        """``eviction_policy`` and ``classes``: the index's (``LruIndex``)."""
        self.dir = directory
        self.block_bytes = block_bytes
        self.owner = deployment or NO_DEPLOYMENT
        os.makedirs(directory, exist_ok=True)
        self.index = LruIndex(capacity_bytes, eviction_policy, classes)
        self.lock = threading.Lock()
        self.num_deleted_corrupt = 0
        self.num_write_errors = 0
        self.off: str | None = None  # why the tier stores and serves nothing any more (the directory was taken)
        self._writing: set[bytes] = set()  # keys indexed whose files are not complete yet
        self._vanished = False  # the directory is gone and could not be recreated yet (logged once)
        self._repairing = threading.Lock()  # one thread recreates a vanished directory
        self._failures_unlogged, self._log_due = 0, 0.0
        self._dir_lock = lock_directory(directory)
        try:
            if self._claim():
                self._scan()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Let another engine use the directory (the lock also goes when this process ends)."""
        if self._dir_lock is not None:
            self._dir_lock.release()

    def _path(self, key: bytes) -> str:
        return os.path.join(self.dir, key.hex() + SUFFIX)

    def _entries(self) -> list[tuple[str, str, os.stat_result]]:
        """(name, path, stat) of the block files and unfinished writes in the directory; anything else named like
        them (a subdirectory, a link) is skipped with a warning."""
        try:
            names = sorted(os.listdir(self.dir))
        except OSError as e:
            logger.warning("disk cache %s: cannot list it (%s): no block files indexed", self.dir, e.strerror or e)
            return []
        found = []
        for name in names:
            if not name.endswith((SUFFIX, TMP_SUFFIX)):
                continue
            path = os.path.join(self.dir, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                logger.warning("disk cache %s: %s is not a regular file: skipped", self.dir, name)
                continue
            found.append((name, path, st))
        return found

    def _claim(self) -> bool:
        """Whether the files found may be indexed: written under this deployment, or none left (deleted now, and
        this deployment recorded). Files of another deployment that cannot be deleted stay unread."""
        if owner_of(self.dir) == self.owner:
            return True
        entries = self._entries()
        kept = [name for name, path, _ in entries if not self._delete(path)]
        if entries:
            logger.info("disk cache %s: written under another deployment (another tenants database): %d files "
                        "removed", self.dir, len(entries) - len(kept))
        if kept or not record_owner(self.dir, self.owner):
            logger.warning("disk cache %s: files of another deployment remain: none of them is read", self.dir)
            return False
        return True

    def _scan(self) -> None:
        """Index the files a previous engine left, oldest first (by modification time); files of other layouts
        are indexed too (they share the directory's capacity) but never match this engine's keys."""
        found = []
        for name, path, st in self._entries():
            if name.endswith(TMP_SUFFIX):
                self._delete(path)  # a write that never finished
                continue
            try:
                key = bytes.fromhex(name[:-len(SUFFIX)])
                with open(path, "rb") as f:
                    head = f.read(len(MAGIC) + KEY_BYTES + 2)
                    (tlen,) = struct.unpack("<H", head[-2:])
                    tenant = f.read(tlen).decode()
                if len(key) != KEY_BYTES or head[:len(MAGIC)] != MAGIC or head[len(MAGIC):-2] != key:
                    raise ValueError("bad header")
            except (ValueError, OSError, struct.error, UnicodeDecodeError):
                self._delete(path)  # one that cannot be deleted is skipped (warned), never indexed
                continue
            found.append((st.st_mtime_ns, key, tenant, st.st_size, path))
        for _, key, tenant, size, path in sorted(found):
            if self.index.victims(tenant, size, None) is None:
                self._delete(path)
                continue
            for victim in self.index.victims(tenant, size, None):
                self._delete(self.index.remove(victim).handle)
            self.index.add(key, Entry(tenant, size, path))

    def _delete(self, path: str) -> bool:
        """Remove a file; False (warned) if it cannot be."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("disk cache %s: cannot delete %s (%s): skipped", self.dir, os.path.basename(path),
                           e.strerror or e)
            return False
        return True

    def contains(self, key: bytes) -> bool:
        with self.lock:
            return key in self.index

    def write(self, key: bytes, tenant: str, payload: bytes, share: float | None) -> Written:
        """Store one block (nothing to do if present). Runs on the writer thread."""
        header = _header(key, tenant, payload)
        size = len(header) + len(payload)
        with self.lock:
            if key in self.index or self.off:
                return Written([], False)
            victims = self.index.victims(tenant, size, share)
            if victims is None:
                return Written([], False)
            evicted = [(v, self.index.remove(v)) for v in victims]
            path = self._path(key)
            # Indexed before the file is complete: a read of it meanwhile finds no file and is a miss.
            entry = Entry(tenant, size, path)
            self.index.add(key, entry)
            self._writing.add(key)
        for _, old in evicted:
            self._delete(old.handle)
        tmp = f"{path}.{threading.get_ident()}{TMP_SUFFIX}"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            with self.lock:
                self._writing.discard(key)
                if self.index.get(key, touch=False) is entry:
                    self.index.remove(key)
                self.num_write_errors += 1
            self._write_failed(e)
            return Written(evicted, False, True)
        with self.lock:
            self._writing.discard(key)
        return Written(evicted, True)

    def _write_failed(self, error: OSError) -> None:
        if error.errno == errno.ENOENT and not os.path.isdir(self.dir):
            self._directory_vanished()
            return
        self._failures_unlogged += 1
        now = time.monotonic()
        if now >= self._log_due:
            logger.warning("disk cache %s: %d block writes failed (last: %s); nothing of them was kept", self.dir,
                           self._failures_unlogged, error.strerror or error)
            self._failures_unlogged, self._log_due = 0, now + LOG_EVERY_S

    def _directory_vanished(self) -> None:
        """The directory is gone (deleted while the engine ran): every indexed file went with it. Recreate it, or
        say once that the tier keeps nothing until it exists again."""
        with self._repairing:
            if not self._vanished and self._still_ours():
                return  # the other thread (reader, writer) found it first and recreated it
            self._recreate()

    def _still_ours(self) -> bool:
        """Whether the directory's lock file is the one this tier holds (not a directory made anew)."""
        fd = self._dir_lock.fd if self._dir_lock is not None else None
        try:
            return fd is not None and os.fstat(fd).st_ino == os.stat(os.path.join(self.dir, LOCK_FILE)).st_ino
        except OSError:
            return False

    def _recreate(self) -> None:
        with self.lock:
            lost = len(self.index)
            self.index = LruIndex(self.index.capacity, self.index.policy, self.index.classes)
        first = not self._vanished
        try:
            os.makedirs(self.dir, exist_ok=True)
            self.close()
            self._dir_lock = lock_directory(self.dir)
            record_owner(self.dir, self.owner)
        except DiskCacheBusy as e:
            self.off = str(e)
            logger.error("disk cache %s vanished and another engine took its place: the disk tier is off (%s)",
                         self.dir, e)
            return
        except OSError as e:
            self._vanished = True
            if first:
                logger.error("disk cache %s vanished (%d blocks lost) and cannot be recreated (%s): the disk tier "
                             "keeps nothing until it exists again", self.dir, lost, e.strerror or e)
            return
        self._vanished = False
        logger.error("disk cache %s vanished (%d blocks lost): recreated it", self.dir, lost)

    def read(self, key: bytes) -> tuple[str, bytes] | None:
        """(tenant, payload) of a block, or None: absent, or corrupt or truncated (then deleted)."""
        with self.lock:
            entry = self.index.get(key)
            if entry is None or self.off:
                return None
            path = entry.handle
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self._missing(key, entry)
            return None
        except OSError as e:
            logger.warning("disk cache %s: cannot read %s (%s)", self.dir, os.path.basename(path), e.strerror or e)
            return None
        payload = self._check(key, data)
        if payload is None:
            with self.lock:
                if self.index.get(key, touch=False) is not None:
                    self.index.remove(key)
            self._delete(path)
            self.num_deleted_corrupt += 1
            return None
        return payload

    def _missing(self, key: bytes, entry: Entry) -> None:
        """An indexed file that is not there: still being written, or deleted behind the engine's back (alone, or
        with the whole directory)."""
        with self.lock:
            if key in self._writing or os.path.exists(entry.handle):
                return
            if self.index.get(key, touch=False) is entry:
                self.index.remove(key)
        if not os.path.isdir(self.dir):
            self._directory_vanished()

    def _check(self, key: bytes, data: bytes) -> tuple[str, bytes] | None:
        """The tenant and payload of a file's bytes if every header field and the checksum agree."""
        at = len(MAGIC) + KEY_BYTES + 2
        if len(data) < at or data[:len(MAGIC)] != MAGIC or data[len(MAGIC):at - 2] != key:
            return None
        (tlen,) = struct.unpack("<H", data[at - 2:at])
        if len(data) < at + tlen + 24:
            return None
        tenant = data[at:at + tlen]
        (plen,) = struct.unpack("<Q", data[at + tlen:at + tlen + 8])
        digest = data[at + tlen + 8:at + tlen + 24]
        payload = data[at + tlen + 24:]
        if plen != self.block_bytes or len(payload) != plen or hashlib.blake2b(payload, digest_size=16).digest() != digest:
            return None
        try:
            return tenant.decode(), payload
        except UnicodeDecodeError:
            return None
