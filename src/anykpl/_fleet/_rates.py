"""The words every fleet module shares: a rate in its two dimensions, the modes a worker runs
in, and the per-dimension maximum and minimum that skip "no limit" (``None``).

Pure: no I/O, no clock. See docs/fleet.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, NamedTuple

__all__ = ("Mode", "Rates", "max_of", "min_of")

Mode = Literal["bootstrap", "granted", "safe"]


class Rates(NamedTuple):
    """Records and bytes per second; ``None`` is "no limit" in that dimension."""

    records_per_second: float | None
    bytes_per_second: float | None


def max_of(values: Iterable[Any]) -> Any:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def min_of(values: Iterable[Any]) -> Any:
    present = [v for v in values if v is not None]
    return min(present) if present else None
