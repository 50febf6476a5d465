"""The vision encoder's outputs kept across requests: an image sent again (by the same tenant) is not encoded again.

Entries are keyed by the digest of the preprocessed pixels the tower reads (``PromptImage.digest``: the grid and
the float32 patches, so two files that decode and resize to the same pixels share an entry) and the tenant's
prefix-cache salt (``RequestPolicy.cache_salt``), so a tenant never receives another tenant's features, not even
as a timing difference. The cache belongs to one loaded model: another model (another engine) has its own.

Entries live in host memory (a device engine copies them back on a hit: a few MB, against a tower forward), sized
in bytes; the least recently used go first. A request holds its images' features itself until it finishes, so
an entry evicted while a request still reads it costs nothing but the memory that request already had.

A tenant may be held to a share of the cache, as in the prefix-cache tiers (the same ``LruIndex``): with a share
``s`` (its quota's cache share, else ``EngineConfig.encoder_cache_tenant_share``) its entries take at most ``s``
of the capacity, and a new entry that would pass that evicts its own least recently used ones, nobody else's.
Only an entry that does not fit the whole cache evicts others' (least recently used first), so a tenant
flooding the cache with distinct images never pushes out another's entries while the two fit together.
"""

from collections import defaultdict

import torch

from engine.core.lru_index import Entry, LruIndex
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
    """An LRU of ``VisionFeatures`` by (image digest, cache salt), at most ``capacity_bytes`` of them, each tenant's
    entries within its share (``tenant_share``: the default share, in (0, 1]; None: unbounded, one LRU).

    ``capacity_bytes`` 0: nothing is kept (every lookup misses). ``hits``, ``misses`` and ``evictions`` count since
    start (the engine's Prometheus counters); ``evicted_by_tenant``: evictions by whose entry went;
    ``not_kept``: features not stored, larger than the cache or than their tenant's share; ``bytes_used`` is what
    the entries take now, ``bytes_by_tenant`` each tenant's part of it.
    """

    def __init__(self, capacity_bytes: int, tenant_share: float | None = None) -> None:
        assert capacity_bytes >= 0
        assert tenant_share is None or 0 < tenant_share <= 1
        self.capacity_bytes = capacity_bytes
        self.tenant_share = tenant_share
        self._index = LruIndex(capacity_bytes)  # keys (digest, salt); an entry's handle is its VisionFeatures
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.not_kept = 0
        self.evicted_by_tenant: defaultdict[str, int] = defaultdict(int)

    @property
    def bytes_used(self) -> int:
        return self._index.used

    @property
    def bytes_by_tenant(self) -> dict[str, int]:
        return dict(self._index.used_by_tenant)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: tuple[bytes, str | None]) -> bool:
        """Whether ``(digest, salt)`` is held now (no recency change, nothing counted: the scheduler's question)."""
        return key in self._index

    def share_of(self, share: float | None) -> float | None:
        """The share a tenant is held to: its own (its quota's cache share), else the cache's default."""
        return share if share is not None else self.tenant_share

    def get(self, digest: bytes, salt: str | None, device: torch.device) -> VisionFeatures | None:
        """The features kept for the image, on ``device`` (a hit, now the most recent), or None (a miss)."""
        entry = self._index.get((digest, salt))
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        features = entry.handle
        return VisionFeatures(features.embeds.to(device, non_blocking=True),
                              features.deepstack.to(device, non_blocking=True))

    def put(self, digest: bytes, salt: str | None, features: VisionFeatures, tenant: str = "default",
            share: float | None = None) -> None:
        """Keep a host copy of ``features`` for ``tenant``, evicting for room: its own least recently used entries
        past its share (``share``, else the cache's ``tenant_share``; None: no share), then, if the cache is
        full, the least recently used of anyone's. Features larger than the cache or the share are not kept."""
        key = (digest, salt)
        if key in self._index:
            return
        size = _nbytes(features)
        victims = self._index.victims(tenant, size, self.share_of(share))
        if victims is None:
            self.not_kept += 1
            return
        for victim in victims:
            old = self._index.remove(victim)
            self.evictions += 1
            self.evicted_by_tenant[old.tenant] += 1
        self._index.add(key, Entry(tenant, size, VisionFeatures(_to_host(features.embeds),
                                                                _to_host(features.deepstack))))
