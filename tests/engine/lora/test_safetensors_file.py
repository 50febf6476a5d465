"""``engine.lora.safetensors_file.load_tensors`` gives exactly the tensors of the safetensors library
(``safetensors.torch.load_file``): random files in bf16, fp16 and fp32 as ``save_file`` writes them, and files
written by hand whose header length and tensor offsets leave tensors unaligned for their dtype (copied then,
never misaligned views). Files the library refuses are refused (a ValueError)."""

import json
import math
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.lora.safetensors_file import load_tensors

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "U8": torch.uint8, "I64": torch.int64}


def _random_tensors(rng: random.Random, dtype: torch.dtype, count: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    tensors = {}
    for i in range(count):
        shape = [rng.randint(0 if i == 0 else 1, 9) for _ in range(rng.randint(1, 3))]  # the first may be empty
        if dtype.is_floating_point:
            tensors[f"t{i}.lora_{'AB'[i % 2]}.weight"] = torch.randn(shape, generator=g).to(dtype)
        else:
            tensors[f"t{i}"] = torch.randint(0, 100, shape, generator=g).to(dtype)
    return tensors


def _assert_same(got: dict, want: dict, seed: int) -> None:
    assert list(sorted(got)) == list(sorted(want)), f"seed={seed}"
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, f"seed={seed} {name}"
        assert torch.equal(got[name], tensor), f"seed={seed} {name}"
        if got[name].numel():  # never a misaligned view
            assert got[name].data_ptr() % got[name].element_size() == 0, f"seed={seed} {name}"


def _write_by_hand(path, tensors: dict[str, torch.Tensor], header_pad: int) -> None:
    """A safetensors file with the tensors' bytes back to back in the given order (no alignment padding) and a
    header ``header_pad`` spaces longer than its JSON (so the data may start at any byte of the file)."""
    entries, data, offset = {}, b"", 0
    for name, tensor in tensors.items():
        raw = tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        code = next(k for k, v in DTYPES.items() if v == tensor.dtype)
        entries[name] = {"dtype": code, "shape": list(tensor.shape), "data_offsets": [offset, offset + len(raw)]}
        data, offset = data + raw, offset + len(raw)
    header = json.dumps(entries).encode() + b" " * header_pad
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header + data)


@pytest.mark.parametrize("code", ["BF16", "F16", "F32"])
def test_saved_files_equal_the_library(tmp_path, code):
    for _ in range(5):
        seed = random.randrange(2**31)
        rng = random.Random(seed)
        want = _random_tensors(rng, DTYPES[code], rng.randint(1, 12))
        path = str(tmp_path / "adapter_model.safetensors")
        save_file(want, path, metadata={"format": "pt"})
        got = load_tensors(path)
        _assert_same(got, load_file(path), seed)
        _assert_same(got, want, seed)
        # No copy: the library's writer aligns every tensor, so each is a view of the one buffer read.
        buffers = {t.untyped_storage().data_ptr() for t in got.values() if t.numel()}
        assert len(buffers) <= 1, f"seed={seed}"


def test_unaligned_offsets_are_copied_exactly(tmp_path):
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    odd = torch.randint(0, 255, (rng.choice([1, 3, 5, 7]),), dtype=torch.uint8)  # puts what follows off alignment
    tensors = {"odd": odd}
    for code in ("F32", "BF16", "F16", "I64"):
        tensors.update({f"{code}.{k}": v for k, v in _random_tensors(rng, DTYPES[code], 3).items()})
    # Forced, not left to chance: after the odd-sized first tensor, the next non-empty one is unaligned.
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    assert any(s % t.element_size() for s, t in zip(starts, tensors.values()) if t.numel()), f"seed={seed}"
    for header_pad in range(8):  # the data starts at every byte offset of the file modulo 8
        path = str(tmp_path / f"hand{header_pad}.safetensors")
        _write_by_hand(path, tensors, header_pad)
        got = load_tensors(path)
        _assert_same(got, load_file(path), seed)
        _assert_same(got, tensors, seed)


@pytest.mark.parametrize("damage", ["truncated", "hole", "overlap", "size", "dtype", "not_json", "no_header"])
def test_damaged_files_are_refused_as_the_library_refuses_them(tmp_path, damage):
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    tensors = _random_tensors(rng, torch.float32, 3)
    tensors = {k: v for k, v in tensors.items() if v.numel()} or {"x": torch.ones(2)}
    path = str(tmp_path / "bad.safetensors")
    _write_by_hand(path, tensors, 0)
    with open(path, "rb") as f:
        blob = f.read()
    size = int.from_bytes(blob[:8], "little")
    header, data = json.loads(blob[8:8 + size]), blob[8 + size:]
    first = next(iter(header))
    if damage == "truncated":
        data = data[:-1]
    elif damage == "hole":
        data += b"\0" * 4
    elif damage == "overlap":
        header[first]["data_offsets"][1] += 4
        header[first]["shape"] = [math.prod(header[first]["shape"]) + 1]
    elif damage == "size":
        header[first]["shape"] = [math.prod(header[first]["shape"]) + 1]
    elif damage == "dtype":
        header[first]["dtype"] = "F7"
    raw_header = b"{not json" if damage == "not_json" else json.dumps(header).encode()
    blob = (len(raw_header).to_bytes(8, "little") + raw_header + data) if damage != "no_header" else b"\xff" * 20
    with open(path, "wb") as f:
        f.write(blob)
    with pytest.raises(Exception):  # the library refuses it (its own error types) ...
        load_file(path)
    with pytest.raises(ValueError):  # ... and so does the reader, with a ValueError
        load_tensors(path)
