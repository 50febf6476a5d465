"""How a layer names its tensor-parallel rank's part of a checkpoint tensor (``tp_slices``).

A layer's ``tp_slices(local_name, rank)`` returns None (the whole tensor), a tuple of slices (one index into
the tensor), or ``RowRuns``: several runs of rows read separately and concatenated in order, for tensors whose
rows are sections each split over the ranks (a [q | k | v] projection: the rank's q rows, then its k rows, then
its v rows). The loader (``engine.loading.model_loader``) reads exactly those rows.
"""


class RowRuns(list):
    """Indexes (tuples of slices) into dim 0 of one tensor, concatenated along dim 0 in this order."""
