"""Per-step metadata staging: values round-trip, and every view starts 16-byte aligned.

Triton specializes kernels on each pointer's 16-byte alignment; a view whose
alignment depended on the previous arrays' lengths would recompile kernels
at random steps (seen on an H100 as 1-2 s stalls on first occurrences).
"""

import random

import torch

from engine.device_batch.staging import stage_int64


def test_views_round_trip_and_are_16_byte_aligned():
    rng = random.Random()
    for _ in range(50):
        arrays = []
        for _ in range(rng.randint(1, 6)):
            if rng.random() < 0.3:
                width = rng.randint(1, 5)
                arrays.append([[rng.randrange(-9, 10**12) for _ in range(width)] for _ in range(rng.randint(1, 4))])
            else:
                arrays.append([rng.randrange(-9, 10**12) for _ in range(rng.randint(0, 7))])
        views = stage_int64(arrays, torch.device("cpu"))
        assert len(views) == len(arrays)
        for view, arr in zip(views, arrays):
            assert view.tolist() == arr
            assert view.dtype == torch.int64
            assert view.data_ptr() % 16 == 0, f"misaligned view for {arrays}"
