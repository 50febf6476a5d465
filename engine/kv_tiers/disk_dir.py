"""Who may use a disk tier's directory: one engine at a time, and only under the deployment that wrote it.

- ``lock``: an exclusive ``flock`` held while the engine runs (released when its process ends, however it
  ends). A second engine on the same directory is refused at start with one line naming the flag: two engines
  would each index the files and keep to the size on their own, together exceeding it.
- ``deployment``: the deployment (tenants database) whose engines wrote the files. An engine of another one
  (a new or restored database, another server) clears the files before it writes its own id, so blocks never
  outlive the deployment they belong to.

Plain Python, no torch.
"""

import errno
import fcntl
import logging
import os

logger = logging.getLogger(__name__)

LOCK_FILE = "lock"
OWNER_FILE = "deployment"
NO_DEPLOYMENT = "none"  # an engine given no deployment (``LLM`` in Python, an engine without a database)


class DiskCacheBusy(ValueError):
    """Another engine holds the directory; the message is one line naming ``--disk-cache-dir``."""


class DirectoryLock:
    """A held directory lock: its descriptor, closed (the lock released) by ``release`` or when collected."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)  # the flock goes with the descriptor

    def __del__(self) -> None:
        self.release()


def lock_directory(directory: str) -> DirectoryLock | None:
    """Hold the directory's lock (``release`` it), or None where the directory is read-only (nothing can be
    written there, so nobody else writes either: its files are served as they are). DiskCacheBusy if another
    engine holds it."""
    path = os.path.join(directory, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
            logger.warning("disk cache %s: cannot create its lock file (%s): serving its files read-only", directory,
                           e.strerror)
            return None
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        error = _busy(directory, fd)
        os.close(fd)
        raise error from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return DirectoryLock(fd)


def check_free(directory: str) -> None:
    """DiskCacheBusy if an engine holds the directory now (the command line's check before it starts its own
    engines, so that the error is its one line; nothing is created)."""
    try:
        fd = os.open(os.path.join(directory, LOCK_FILE), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return  # no lock file: nobody uses it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _busy(directory, fd) from None
    finally:
        os.close(fd)


def _busy(directory: str, fd: int) -> DiskCacheBusy:
    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
    return DiskCacheBusy(f"--disk-cache-dir {directory} is in use by another engine (process {holder}): give each "
                         "engine its own directory")


def owner_of(directory: str) -> str | None:
    """The deployment recorded in the directory, or None (none recorded, or unreadable)."""
    try:
        with open(os.path.join(directory, OWNER_FILE), encoding="utf-8") as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def record_owner(directory: str, deployment: str) -> bool:
    """Write ``deployment`` as the directory's owner (atomically); False (logged) if it cannot be written."""
    path = os.path.join(directory, OWNER_FILE)
    tmp = path + ".new"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(deployment)
        os.replace(tmp, path)
        return True
    except OSError as e:
        logger.warning("disk cache %s: cannot record its deployment (%s)", directory, e.strerror or e)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False
