"""glibc malloc settings for the CPU engine: keep freed activation memory instead of handing it back.

A CPU forward allocates and frees megabyte-sized activations every step. With glibc's
defaults, such blocks are served by fresh mmap()s (and the heap top is trimmed back to the
kernel), so every step touches new pages and pays a page fault per 4 KiB. Raising the mmap
and trim thresholds keeps those pages in the heap for reuse.
"""

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

# mallopt() parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit (larger values are refused); blocks above it still use mmap.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 256 << 20


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where libc is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): nothing to tune
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        logger.debug("mallopt refused the CPU allocator thresholds")
    return ok
