"""``check_adapter_dir`` (adapter_config.json and the safetensors header only) refuses, with one line, each
malformed adapter that ``load_adapter`` (the whole file, with the base model's shapes) refuses, and accepts and
summarises a well-formed one that ``load_adapter`` reads."""

import pytest

from engine.lora.peft_format import check_adapter_dir, load_adapter
from tests.engine.lora.adapter_dirs import EXPERT_SIZE, EXPERTS, HIDDEN, MALFORMED, write_adapter, write_malformed


def test_well_formed_adapter_is_summarised(tmp_path):
    path = write_adapter(str(tmp_path / "good"), rank=3)
    summary = check_adapter_dir(path)
    assert (summary.rank, summary.target_modules, summary.base_model) == (3, ("experts", "o_proj", "q_proj"), "tiny-moe")
    adapter = load_adapter("good", path, num_experts=EXPERTS, hidden_size=HIDDEN, expert_size=EXPERT_SIZE)
    assert adapter.rank == 3 and len(adapter.experts) == 2


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_adapter_is_refused_with_one_line(tmp_path, case):
    path = write_malformed(str(tmp_path / case), case)
    with pytest.raises(ValueError) as checked:
        check_adapter_dir(path)
    message = str(checked.value)
    assert MALFORMED[case][-1] in message and "\n" not in message and message.startswith(f"adapter at {path}: ")
    with pytest.raises(ValueError):  # the engine refuses it as well: the check is no stricter than the loader
        load_adapter(case, path, num_experts=EXPERTS, hidden_size=HIDDEN, expert_size=EXPERT_SIZE)


def test_not_a_directory(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        check_adapter_dir(str(tmp_path / "missing"))


def test_a_loaded_adapter_keeps_its_weights_when_the_file_is_rewritten_in_place(tmp_path):
    """The loader's tensors are copies: safetensors' own are views of a mapping of the file, so bytes written
    into the file afterwards (an adapter replaced in place) would otherwise show up in the loaded adapter."""
    import os

    import torch

    path = write_adapter(str(tmp_path / "good"), rank=2)
    adapter = load_adapter("good", path, num_experts=EXPERTS, hidden_size=HIDDEN, expert_size=EXPERT_SIZE)
    before = [t.clone() for lin in adapter.linears.values() for part in lin.values() for t in (part.a, part.b)]
    weights = os.path.join(path, "adapter_model.safetensors")
    with open(weights, "r+b") as f:  # every data byte changed, the header kept: same file, same inode
        header = 8 + int.from_bytes(f.read(8), "little")
        size = os.path.getsize(weights)
        f.seek(header)
        f.write(os.urandom(size - header))
    after = [t for lin in adapter.linears.values() for part in lin.values() for t in (part.a, part.b)]
    assert all(torch.equal(x, y) for x, y in zip(before, after))
