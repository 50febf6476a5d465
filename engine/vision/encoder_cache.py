"""The vision encoder's outputs kept across requests: an image sent again (by the same tenant) is not encoded again.

Entries are keyed by the digest of the preprocessed pixels the tower reads (``PromptImage.digest``: the grid and
the float32 patches, so two files that decode and resize to the same pixels share an entry) and the tenant's
prefix-cache salt (``RequestPolicy.cache_salt``), so a tenant never receives another tenant's features, not even
as a timing difference. The cache belongs to one loaded model: another model (another engine) has its own.

Entries live in host memory (a device engine copies them back on a hit: a few MB, against a tower forward), sized
in bytes; the least recently used go first. A request holds its images' features itself until it finishes, so
an entry evicted while a request still reads it costs nothing but the memory that request already had.
"""

from collections import OrderedDict

import torch

from engine.vision.qwen3_vl_tower import VisionFeatures


def _nbytes(features: VisionFeatures) -> int:
    return sum(t.numel() * t.element_size() for t in (features.embeds, features.deepstack))


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t``: pinned and queued on the stream from a GPU (a later copy back is ordered after it)."""
    if t.device.type == "cpu":
        return t  # the tower's own output: nothing writes to it
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


class EncoderCache:
    """An LRU of ``VisionFeatures`` by (image digest, cache salt), at most ``capacity_bytes`` of them.

    ``capacity_bytes`` 0: nothing is kept (every lookup misses). ``hits``, ``misses`` and ``evictions`` count since
    start (the engine's Prometheus counters); ``bytes_used`` is what the entries take now.
    """

    def __init__(self, capacity_bytes: int) -> None:
        assert capacity_bytes >= 0
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[tuple[bytes, str | None], VisionFeatures] = OrderedDict()
        self.bytes_used = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple[bytes, str | None]) -> bool:
        """Whether ``(digest, salt)`` is held now (no recency change, nothing counted: the scheduler's question)."""
        return key in self._entries

    def get(self, digest: bytes, salt: str | None, device: torch.device) -> VisionFeatures | None:
        """The features kept for the image, on ``device`` (a hit, now the most recent), or None (a miss)."""
        key = (digest, salt)
        features = self._entries.get(key)
        if features is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return VisionFeatures(features.embeds.to(device, non_blocking=True),
                              features.deepstack.to(device, non_blocking=True))

    def put(self, digest: bytes, salt: str | None, features: VisionFeatures) -> None:
        """Keep a host copy of ``features``, evicting the least recently used entries for room; features larger
        than the whole cache are not kept."""
        size = _nbytes(features)
        key = (digest, salt)
        if size > self.capacity_bytes or key in self._entries:
            return
        while self.bytes_used + size > self.capacity_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes_used -= _nbytes(old)
            self.evictions += 1
        self._entries[key] = VisionFeatures(_to_host(features.embeds), _to_host(features.deepstack))
        self.bytes_used += size
