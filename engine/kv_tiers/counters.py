"""Per tier and tenant counters of the prefix-cache tiers (exported on /metrics)."""

from collections import defaultdict

FIELDS = ("hits", "misses", "bytes_in", "bytes_out", "evictions", "write_errors")


class TierCounters:
    """Cumulative counts by (tier, tenant): hits and misses are block lookups (a lookup that ends in a tier is
    one miss there), bytes in are written to the tier, bytes out read from it, evictions blocks dropped, write
    errors blocks the disk tier failed to write (a full disk, say; nothing of them is kept)."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0] * len(FIELDS))

    def add(self, tier: str, tenant: str, field: str, amount: int = 1) -> None:
        self._counts[(tier, tenant)][FIELDS.index(field)] += amount

    def get(self, tier: str, tenant: str, field: str) -> int:
        counts = self._counts.get((tier, tenant))
        return counts[FIELDS.index(field)] if counts else 0

    def total(self, tier: str, field: str) -> int:
        i = FIELDS.index(field)
        return sum(c[i] for (t, _), c in self._counts.items() if t == tier)

    def rows(self) -> list[tuple[str, str, list[int]]]:
        """(tier, tenant, counts in FIELDS order) for every pair seen."""
        return [(tier, tenant, list(c)) for (tier, tenant), c in sorted(self._counts.items())]
