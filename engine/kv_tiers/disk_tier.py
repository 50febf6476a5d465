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
"""

import hashlib
import os
import struct
import threading

from engine.kv_tiers.keys import KEY_BYTES
from engine.kv_tiers.lru_index import Entry, LruIndex

MAGIC = b"MGKVBLK1"
SUFFIX = ".kvb"


def _header(key: bytes, tenant: str, payload: bytes | memoryview) -> bytes:
    name = tenant.encode()
    return (MAGIC + key + struct.pack("<H", len(name)) + name + struct.pack("<Q", len(payload))
            + hashlib.blake2b(payload, digest_size=16).digest())


class DiskTier:
    """Size-bounded LRU of block files. Thread-safe: the engine's writer thread stores, the scheduler reads."""

    name = "disk"

    def __init__(self, directory: str, capacity_bytes: int, block_bytes: int) -> None:
        self.dir = directory
        self.block_bytes = block_bytes
        os.makedirs(directory, exist_ok=True)
        self.index = LruIndex(capacity_bytes)
        self.lock = threading.Lock()
        self.num_deleted_corrupt = 0
        self._scan()

    def _path(self, key: bytes) -> str:
        return os.path.join(self.dir, key.hex() + SUFFIX)

    def _scan(self) -> None:
        """Index the files a previous engine left, oldest first (by modification time); files of other layouts
        are indexed too (they share the directory's capacity) but never match this engine's keys."""
        found = []
        for name in os.listdir(self.dir):
            path = os.path.join(self.dir, name)
            if name.endswith(".tmp"):
                os.unlink(path)  # a write that never finished
                continue
            if not name.endswith(SUFFIX):
                continue
            try:
                key = bytes.fromhex(name[:-len(SUFFIX)])
                st = os.stat(path)
                with open(path, "rb") as f:
                    head = f.read(len(MAGIC) + KEY_BYTES + 2)
                    (tlen,) = struct.unpack("<H", head[-2:])
                    tenant = f.read(tlen).decode()
                if len(key) != KEY_BYTES or head[:len(MAGIC)] != MAGIC or head[len(MAGIC):-2] != key:
                    raise ValueError("bad header")
            except (ValueError, OSError, struct.error, UnicodeDecodeError):
                self._delete(path)
                continue
            found.append((st.st_mtime_ns, key, tenant, st.st_size, path))
        for _, key, tenant, size, path in sorted(found):
            if self.index.victims(tenant, size, None) is None:
                self._delete(path)
                continue
            for victim in self.index.victims(tenant, size, None):
                self._delete(self.index.remove(victim).handle)
            self.index.add(key, Entry(tenant, size, path))

    def _delete(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def contains(self, key: bytes) -> bool:
        with self.lock:
            return key in self.index

    def write(self, key: bytes, tenant: str, payload: bytes, share: float | None) -> list[tuple[bytes, Entry]]:
        """Store one block (no-op if present); returns the entries evicted for it. Runs on the writer thread."""
        header = _header(key, tenant, payload)
        size = len(header) + len(payload)
        with self.lock:
            if key in self.index:
                return []
            victims = self.index.victims(tenant, size, share)
            if victims is None:
                return []
            evicted = [(v, self.index.remove(v)) for v in victims]
            path = self._path(key)
            # Indexed before the file is complete: a read of it meanwhile finds no file and is a miss.
            self.index.add(key, Entry(tenant, size, path))
        for _, entry in evicted:
            self._delete(entry.handle)
        tmp = f"{path}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, path)
        return evicted

    def read(self, key: bytes) -> tuple[str, bytes] | None:
        """(tenant, payload) of a block, or None: absent, or corrupt or truncated (then deleted)."""
        with self.lock:
            entry = self.index.get(key)
            if entry is None:
                return None
            path = entry.handle
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None  # still being written
        payload = self._check(key, data)
        if payload is None:
            with self.lock:
                if self.index.get(key, touch=False) is not None:
                    self.index.remove(key)
            self._delete(path)
            self.num_deleted_corrupt += 1
            return None
        return payload

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
