"""What a stored name or label may be: the same rule on SQLite and PostgreSQL.

SQLite does not enforce ``String(n)`` lengths and neither database refuses
control characters, which ``tenant list`` would then print raw to an operator's
terminal (escape sequences included). Every name and label is checked here
before it is written.
"""

import unicodedata
from collections.abc import Iterable


def valid_name(kind: str, value: str, max_length: int) -> str:
    """``value`` stripped, or ValueError naming ``kind``: empty, longer than ``max_length`` characters, or
    holding control, format or unassigned characters."""
    value = value.strip()
    if not value:
        raise ValueError(f"{kind} must not be empty")
    if len(value) > max_length:
        raise ValueError(f"{kind} must be at most {max_length} characters, got {len(value)}")
    bad = next((c for c in value if unicodedata.category(c).startswith("C")), None)
    if bad is not None:
        raise ValueError(f"{kind} must be printable text: it holds the control character U+{ord(bad):04X}")
    return value


def skeleton(value: str) -> str:
    """How ``value`` reads: NFKC-normalised (fullwidth and compatibility forms to their plain letters), case-folded,
    without format characters (zero-width spaces and joiners)."""
    folded = unicodedata.normalize("NFKC", value).casefold()
    return "".join(c for c in folded if unicodedata.category(c) != "Cf")


def reads_as(value: str, names: Iterable[str | None]) -> str | None:
    """The first of ``names`` (None ignored) that ``value`` reads the same as (``skeleton``), or None."""
    mine = skeleton(value)
    return next((n for n in names if n and skeleton(n) == mine), None)
