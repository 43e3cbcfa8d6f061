"""KPL metrics kept in process: counters under the KPL's names (aws/metrics/metrics_constants.h).

Each data point is counted at the level it is emitted (stream, shard, error code) and is also
visible summed over the levels above it, as ``Metric::put`` feeds its ancestors in the KPL.
Upload sinks (CloudWatch and others) come later; this module only counts, and it counts per
batch, never per user record on the hot path.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ("MetricKey", "Metrics")


@dataclass(frozen=True, slots=True, order=True)
class MetricKey:
    """A metric's name and dimensions (``None`` where a dimension does not apply)."""

    name: str
    stream: str | None = None
    shard: str | None = None
    error_code: str | None = None


class Metrics:
    """Counters keyed by :class:`MetricKey`."""

    def __init__(self) -> None:
        self._counts: defaultdict[tuple[str, str | None, str | None, str | None], float] = (
            defaultdict(float)
        )

    def add(
        self, name: str, value: float, stream: str | None, shard: str | None, code: str | None
    ) -> None:
        self._counts[(name, stream, shard, code)] += value

    def snapshot(self) -> Mapping[MetricKey, float]:
        """Every counter, at its own level and summed into the stream and global levels."""
        out: dict[MetricKey, float] = defaultdict(float)
        for (name, stream, shard, code), value in self._counts.items():
            # a set: a stream-level point (shard None) is its own stream-level ancestor
            keys = {
                MetricKey(name, None, None, code),
                MetricKey(name, stream, None, code),
                MetricKey(name, stream, shard, code),
            }
            for key in keys:
                out[key] += value
        return dict(out)

    def by_error_code(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for (name, _, _, code), value in self._counts.items():
            if name == "ErrorsByCode" and code is not None:
                out[code] += int(value)
        return dict(out)
