"""Which rows and columns a grouped-GEMM program owns (``moe_kernels.align``'s blocks of slots, one expert each),
shared by the tile kernels (``triton_backend``) and the swapped-operand ones (``swapped_triton``)."""

import triton
import triton.language as tl


@triton.jit
def tile_coords(num_blocks_m, n_size, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Walk GROUP_M row blocks down one column band before moving right, so the
    # weight tiles of a band stay in L2 while several row blocks use them.
    pid = tl.program_id(0)
    num_blocks_n = tl.cdiv(n_size, BLOCK_N)
    per_group = GROUP_M * num_blocks_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def num_padded_rows(num_padded_ptr, num_blocks_m, SORTED: tl.constexpr, BLOCK_M: tl.constexpr):
    # Rows that hold slots: the expert-aligned count when sorted, else all num_blocks_m blocks (one slot each).
    if SORTED:
        num_padded = tl.load(num_padded_ptr)
    else:
        num_padded = num_blocks_m * BLOCK_M
    return num_padded


@triton.jit
def block_rows(pid_m, sorted_slots_ptr, block_expert_ptr, num_slots, SORTED: tl.constexpr, BLOCK_M: tl.constexpr):
    # -> slots [BLOCK_M] int64, row_ok [BLOCK_M], expert int64
    rows = tl.arange(0, BLOCK_M)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if SORTED:
        slots = tl.load(sorted_slots_ptr + pid_m * BLOCK_M + rows).to(tl.int64)
        row_ok = slots < num_slots  # padding rows hold the sentinel num_slots
    else:
        slots = (pid_m + rows * 0).to(tl.int64)  # one slot per block: only row 0 is real
        row_ok = rows == 0
    return slots, row_ok, expert
