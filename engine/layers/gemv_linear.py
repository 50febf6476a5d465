"""A transform on a built model: dense projections at a handful of rows through the Triton gemv.

Like the fused elementwise kernels and CUDA graphs, this is applied to a model
after it is built, not a branch in the family files: each ``nn.Linear`` whose
shape has gemv launches is swapped for a ``GemvLinear`` that shares its parameters
(tied weights stay tied; state-dict names do not change).

Its launches (``RowLaunches``) say, per row count 0..MAX_GEMV_ROWS, which launch to use, or None for
``F.linear``; ``engine.transforms.gemv_select`` measures it at engine start. The
choice is a tuple lookup on the host, on the row count the batch has anyway:
nothing syncs, and under a CUDA graph capture it is fixed per captured size.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.dense_gemv import MAX_GEMV_ROWS, GemvConfig, dense_gemv

RowLaunches = tuple[GemvConfig | None, ...]  # index: row count 0..MAX_GEMV_ROWS; None: F.linear


@dataclass(frozen=True, slots=True)
class LinearShape:
    """What a gemv launch depends on: out features N, in features K, dtype, bias or not."""

    n: int
    k: int
    dtype: torch.dtype
    bias: bool

    @classmethod
    def of(cls, linear: nn.Linear) -> "LinearShape":
        return cls(linear.out_features, linear.in_features, linear.weight.dtype, linear.bias is not None)

    def __str__(self) -> str:
        return f"{self.k}->{self.n} {str(self.dtype).removeprefix('torch.')}{' +bias' if self.bias else ''}"


class GemvLinear(nn.Linear):
    """``nn.Linear`` that runs ``dense_gemv`` for the row counts its launches cover and ``F.linear`` otherwise.

    Legend: M rows, N out features, K in features.
    """

    launches: RowLaunches

    @classmethod
    def from_linear(cls, linear: nn.Linear, launches: RowLaunches) -> "GemvLinear":
        assert len(launches) == MAX_GEMV_ROWS + 1 and launches[0] is None
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight  # the same Parameter objects: no copy, ties kept
        if linear.bias is None:
            new.register_parameter("bias", None)
        else:
            new.bias = linear.bias
        new.launches = launches
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [M, K] -> [M, N]
        cfg = self.launches[x.shape[0]] if x.dim() == 2 and x.shape[0] <= MAX_GEMV_ROWS else None
        if cfg is None or x.stride(-1) != 1:
            return F.linear(x, self.weight, self.bias)
        return dense_gemv(x, self.weight, self.bias, cfg)

    def extra_repr(self) -> str:
        used = [rows for rows, cfg in enumerate(self.launches) if cfg is not None]
        return f"{super().extra_repr()}, gemv_rows={used}"


def linear_modules(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(qualified name, module) of every ``nn.Linear`` in ``model`` whose weight is contiguous along K."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and m.weight.stride(1) == 1]


def enable_dense_gemv(model: nn.Module, launches: dict[LinearShape, RowLaunches]) -> int:
    """Swap each ``nn.Linear`` whose shape's launches use the gemv somewhere; returns the number swapped."""
    swapped = 0
    for name, linear in linear_modules(model):
        rows = launches.get(LinearShape.of(linear))
        if rows is None or not any(rows):
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, GemvLinear.from_linear(linear, rows))
        swapped += 1
    return swapped
