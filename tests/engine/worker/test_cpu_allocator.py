"""keep_freed_memory: a 16 MiB block freed and asked for again comes from the heap, not a fresh mmap.

Each case runs in its own interpreter (mallopt settings are per process), with glibc's
mallinfo2 as the independent witness of where a block lives; no torch import, so it is quick.
"""

import ctypes
import ctypes.util
import subprocess
import sys

import pytest

PROBE = """
import ctypes, ctypes.util, sys
if sys.argv[1] == "tuned":
    from engine.worker.cpu_allocator import keep_freed_memory
    assert keep_freed_memory()
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = Info
block = libc.malloc(16 << 20)
print(libc.mallinfo2().hblkhd >= 16 << 20)  # True: the block is its own mmap
libc.free(block)
"""


def _glibc_with_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="needs glibc >= 2.33")
@pytest.mark.parametrize(("mode", "mmapped"), [("default", "True"), ("tuned", "False")])
def test_large_blocks_stay_in_the_heap(mode, mmapped):
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == mmapped, out.stderr
