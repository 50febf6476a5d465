"""Reading a safetensors file into CPU tensors with one read of its data and no copy per tensor.

The format: 8 bytes, the header's length N (little-endian u64); N bytes of JSON, ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}``; then the data, where each tensor's bytes (row-major,
little-endian) are ``[begin, end)``. The data is read into one private buffer (not mapped, as the safetensors
library's ``load_file`` maps it: a file rewritten in place while its tensors are held would change them, or end the
process when truncated), and each tensor is a view of it when its start is aligned for its dtype, else a copy.
Per tensor that is one ``as_strided`` view, where the library spends several times longer. The header is checked as
the safetensors library checks it (known dtypes, sizes that match the shapes, tensors that tile the data with no
hole or overlap); a file it would refuse is a ``ValueError``.
"""

import json
import math
import os
import sys
from typing import BinaryIO

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
HEADER_LIMIT = 100 << 20  # a header is JSON; anything near this is no adapter's


def read_header(f: BinaryIO) -> tuple[dict, int]:
    """(the header's tensor entries, name -> entry, without ``__metadata__``; where the data starts) of an open
    safetensors file, reading the header alone. ValueError if there is none."""
    prefix = f.read(8)
    size = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
    if not 2 <= size <= HEADER_LIMIT:
        raise ValueError("no safetensors header")
    header = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + size


def _spans(header: dict, data_len: int) -> list[tuple[str, torch.dtype, list[int], int, int]]:
    """(name, dtype, shape, begin, end) of each tensor, by begin; ValueError where the header and data disagree."""
    spans = []
    for name, entry in header.items():
        dtype = DTYPES.get(entry.get("dtype")) if isinstance(entry, dict) else None
        if dtype is None:
            raise ValueError(f"tensor {name!r}: no dtype, or one not read here")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise ValueError(f"tensor {name!r}: shape or data_offsets missing")
        begin, end = offsets
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"tensor {name!r}: data_offsets {offsets} do not hold {shape} {entry['dtype']}")
        spans.append((name, dtype, shape, begin, end))
    spans.sort(key=lambda s: (s[3], s[4]))
    covered = 0
    for name, _, _, begin, end in spans:
        if begin != covered:
            raise ValueError(f"tensor {name!r}: data_offsets leave a hole or overlap at byte {covered}")
        covered = end
    if covered != data_len:
        raise ValueError(f"the tensors hold {covered} bytes of the {data_len} of data")
    return spans


def load_tensors(file: str) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors ``file``, on the CPU, in the header's order: views of one buffer holding the
    file's data where aligned, copies elsewhere. ValueError for a file that is not safetensors (or OSError)."""
    if sys.byteorder != "little":  # the data is little-endian: views would be wrong here
        from safetensors.torch import load_file

        return load_file(file)
    with open(file, "rb") as f:
        header, start = read_header(f)
        data_len = os.fstat(f.fileno()).st_size - start
        if data_len < 0:
            raise ValueError("the file ended inside its header")
        raw = torch.empty(data_len, dtype=torch.uint8)  # [data_len], not zeroed: read into below
        f.seek(start)
        if raw.numel() and f.readinto(raw.numpy()) != raw.numel():
            raise ValueError("the file ended early")
    spans = {s[0]: s for s in _spans(header, raw.numel())}
    typed: dict[torch.dtype, torch.Tensor] = {}  # the whole buffer as each dtype met (a view; raw is 64-byte aligned)
    tensors = {}
    for name in header:
        _, dtype, shape, begin, end = spans[name]
        size = dtype.itemsize
        if begin % size or raw.data_ptr() % size:  # a start not aligned for the dtype: its own, aligned memory
            tensors[name] = raw[begin:end].clone().view(dtype).view(shape)
            continue
        whole = typed.get(dtype)
        if whole is None:
            whole = typed[dtype] = raw[:raw.numel() - raw.numel() % size].view(dtype)  # [data_len // size]
        strides, step = [], 1
        for d in reversed(shape):  # row-major
            strides.append(step)
            step *= d
        tensors[name] = whole.as_strided(shape, strides[::-1], begin // size)  # one view: cheaper than slicing
    return tensors
