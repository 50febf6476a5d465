"""Copies whole blocks between the device KV caches and host slots: one block over every attention layer is
one row of ``block_bytes`` bytes, each layer's cache tensors' block rows one after another.

On CUDA, saves run on a side stream (after the work already queued, and the main stream waits for them before
its next forward, which may overwrite the saved blocks), into pinned memory; loads are queued on the main stream
before the forward that reads them. The host never waits for either. On the CPU these are plain copies.
"""

import torch


class BlockCopier:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, ...]], device: torch.device) -> None:
        # Every cache tensor [num_blocks + 1, block_size, *per-token shape]; one block is tensor[block_id]. With two
        # cache groups two layers share their tensors (engine.worker.cache_groups): each is copied once.
        unique = {id(t): t for layer in kv_caches for t in layer}
        self.tensors = list(unique.values())
        self.device = device
        self.sizes = [t[0].numel() * t.element_size() for t in self.tensors]
        self.block_bytes = sum(self.sizes)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _views(self, row: torch.Tensor) -> list[torch.Tensor]:
        """row [block_bytes] uint8 -> one view per cache tensor, shaped like tensor[block_id]."""
        views, at = [], 0
        for t, size in zip(self.tensors, self.sizes):
            views.append(row[at:at + size].view(t.dtype).view(t.shape[1:]))
            at += size
        return views

    def save(self, pairs: list[tuple[int, torch.Tensor]]) -> object | None:
        """Copy each (block id, host row [block_bytes] uint8) from the device; returns the CUDA event that marks
        the copies done (None on the CPU, where they are done on return)."""
        if not pairs:
            return None
        if self.stream is None:
            for block_id, row in pairs:
                for view, t in zip(self._views(row), self.tensors):
                    view.copy_(t[block_id])
            return None
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)  # after the steps that wrote these blocks (and loads that read the rows)
        with torch.cuda.stream(self.stream):
            for block_id, row in pairs:
                for view, t in zip(self._views(row), self.tensors):
                    view.copy_(t[block_id], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        main.wait_stream(self.stream)  # the next forward may reuse the saved blocks
        return done

    def load(self, pairs: list[tuple[torch.Tensor, int]]) -> object | None:
        """Copy each (host row, block id) into the device caches, queued before the next forward; returns the CUDA
        event after which the host rows may be reused (None on the CPU: done on return)."""
        for row, block_id in pairs:
            for view, t in zip(self._views(row), self.tensors):
                t[block_id].copy_(view, non_blocking=self.stream is not None)
        if self.stream is None or not pairs:
            return None
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        return done
