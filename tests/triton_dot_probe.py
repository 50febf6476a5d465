"""A kernel for tests/test_triton_compile_check.py: ``tl.dot`` over a BLOCK x BLOCK tile, which the GPU
compiler accepts only for BLOCK >= 16 (the interpreter runs any size)."""

import triton
import triton.language as tl


@triton.jit
def dot_tile_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tile = tl.load(x_ptr + offs[:, None] * BLOCK + offs[None, :])  # [BLOCK, BLOCK]
    tl.store(y_ptr + offs[:, None] * BLOCK + offs[None, :], tl.dot(tile, tile))
