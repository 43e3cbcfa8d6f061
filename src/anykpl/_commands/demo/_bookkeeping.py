"""The demo's bookkeeping: what happened to the readings, and each shard's rate against its
limits.

:class:`Tally` is fed by the putting tasks and read by the progress views and the final report;
:func:`shard_rates_from_emulator` turns the emulator's per-second counts into the same
:class:`ShardRate` rows. Everything here is synchronous and takes the time as an argument
(seconds since the start), so it is tested without an event loop or a clock.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..._core._limits import SHARD_BYTES_PER_SECOND

__all__ = (
    "RATE_WINDOW",
    "LatencyHistogram",
    "ShardRate",
    "shard_number",
    "Tally",
    "percentile",
    "shard_rates_from_emulator",
)

#: The window, in seconds, that the live rates and percentiles cover.
RATE_WINDOW = 2.0


class LatencyHistogram:
    """Latencies in logarithmic buckets 1 % wide: percentiles of any number of samples in a
    few hundred integers, within 1 % of the exact value."""

    _GROWTH = math.log(1.01)

    def __init__(self) -> None:
        self._buckets: Counter[int] = Counter()
        self.count = 0
        self.max = 0.0

    def add(self, seconds: float) -> None:
        bucket = math.ceil(math.log(max(seconds, 1e-6)) / self._GROWTH)
        self._buckets[bucket] += 1
        self.count += 1
        if seconds > self.max:
            self.max = seconds

    def percentile(self, q: float) -> float | None:
        """The ``q``-th percentile (0..100) in seconds (a bucket's upper edge), or None."""
        if not self.count:
            return None
        rank = max(1, math.ceil(self.count * q / 100))
        seen = 0
        for bucket in sorted(self._buckets):
            seen += self._buckets[bucket]
            if seen >= rank:
                return min(math.exp(bucket * self._GROWTH), self.max)
        return self.max  # pragma: no cover (the ranks add up to count)


def percentile(samples: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100, nearest rank) of ``samples``, or None when empty."""
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(len(ordered) * q / 100) - 1)]


@dataclass(frozen=True)
class ShardRate:
    """One shard's write rate over the last few whole seconds, against its limits.

    Attributes:
        shard_id: the shard.
        records_per_second: records per second; Kinesis records (what the service limits)
            when measured by the emulator, user records when measured by the producer.
        bytes_per_second: data + partition key bytes per second.
        throttled: records throttled on this shard so far.
        limit_records: the shard's record limit, or None (not limited, or not comparable).
        limit_bytes: the shard's byte limit, or None when not limited.
    """

    shard_id: str
    records_per_second: float
    bytes_per_second: float
    throttled: int
    limit_records: float | None
    limit_bytes: float | None


def shard_number(shard_id: str) -> str:
    """``shardId-000000000004`` as ``4`` (another id as it is)."""
    tail = shard_id.rsplit("-", 1)[-1]
    return str(int(tail)) if tail.isdigit() else shard_id


def shard_rates_from_emulator(
    stats: Mapping[str, Any], stream: str, window: int = 2
) -> list[ShardRate]:
    """Each open shard's rate of ``stream`` over the last ``window`` whole seconds, from the
    emulator's ``stats()`` (see docs/emulator.md)."""
    last = int(stats["uptime"]) - 1  # the second in progress is not whole yet
    first = last - window + 1
    rates = []
    for shard in stats["shards"]:
        if shard["stream"] != stream or not shard.get("open", True):
            continue
        records = stored = 0
        for second, accepted_records, accepted_bytes, *_ in shard["per_second"]:
            if first <= second <= last:
                records += accepted_records
                stored += accepted_bytes
        span = max(1, min(window, last + 1))
        rates.append(
            ShardRate(
                shard_id=shard["shard_id"],
                records_per_second=records / span,
                bytes_per_second=stored / span,
                throttled=int(shard["throttled_records"]),
                limit_records=shard.get("limit_records"),
                limit_bytes=shard.get("limit_bytes"),
            )
        )
    return sorted(rates, key=lambda rate: rate.shard_id)


class Tally:
    """What happened to the readings: counts, latencies, per-shard throughput.

    Fed by the putting tasks (:meth:`offered`, :meth:`acknowledged`, :meth:`failed`) with
    times in seconds since the start; read by the progress view and the final report. Keeps
    every acknowledged and failed reading for the read-back check.
    """

    def __init__(self) -> None:
        self.offered_count = 0
        self.acknowledged_records: set[tuple[str, bytes]] = set()
        self.failed_records: set[tuple[str, bytes]] = set()
        self.failures_by_code: Counter[str] = Counter()
        self.latencies = LatencyHistogram()
        self.acknowledged_bytes = 0
        self.shard_totals: dict[str, list[int]] = {}  # shard -> [user records, bytes]
        self._recent: deque[tuple[float, float]] = deque()  # (acknowledged at, latency)
        self._shard_seconds: dict[str, dict[int, list[int]]] = {}
        self._samples: deque[tuple[float, int, int]] = deque([(0.0, 0, 0)])

    @property
    def acknowledged_count(self) -> int:
        return len(self.acknowledged_records)

    @property
    def failed_count(self) -> int:
        return len(self.failed_records)

    def offered(self, count: int) -> None:
        """``count`` more readings were handed to the producer."""
        self.offered_count += count

    def acknowledged(
        self, record: tuple[str, bytes], shard_id: str | None, latency: float, at: float
    ) -> None:
        """``record`` was put into ``shard_id``, ``latency`` seconds after the call, ``at``
        seconds after the start."""
        self.acknowledged_records.add(record)
        self.latencies.add(latency)
        self._recent.append((at, latency))
        size = len(record[0]) + len(record[1])  # device names are ASCII
        self.acknowledged_bytes += size
        shard = shard_id or "?"
        totals = self.shard_totals.setdefault(shard, [0, 0])
        totals[0] += 1
        totals[1] += size
        second = self._shard_seconds.setdefault(shard, {}).setdefault(int(at), [0, 0])
        second[0] += 1
        second[1] += size

    def failed(self, record: tuple[str, bytes], code: str | None) -> None:
        """``record`` failed for good, with error code ``code``."""
        self.failed_records.add(record)
        self.failures_by_code[code or "unknown"] += 1

    def sample_rates(self, now: float, window: float = RATE_WINDOW) -> tuple[float, float]:
        """Note the counts at ``now``; return (offered, acknowledged) readings per second since
        the oldest note in the last ``window`` seconds (or the start)."""
        samples = self._samples
        samples.append((now, self.offered_count, self.acknowledged_count))
        while len(samples) > 2 and samples[1][0] <= now - window:
            samples.popleft()
        then, offered, acknowledged = samples[0]
        span = now - then
        if span <= 0:
            return 0.0, 0.0
        offered_rate = (self.offered_count - offered) / span
        acknowledged_rate = (self.acknowledged_count - acknowledged) / span
        return offered_rate, acknowledged_rate

    def recent_percentiles(
        self, now: float, window: float = RATE_WINDOW
    ) -> tuple[float | None, float | None]:
        """p50 and p99 latency of the records acknowledged in the last ``window`` seconds."""
        recent = self._recent
        while recent and recent[0][0] < now - window:
            recent.popleft()
        latencies = [latency for _, latency in recent]
        return percentile(latencies, 50), percentile(latencies, 99)

    def shard_rates(self, now: float, window: int = 2) -> list[ShardRate]:
        """Each shard's acknowledged user records and bytes per second over the last
        ``window`` whole seconds, as the producer saw them (used without the emulator)."""
        last = int(now) - 1
        rates = []
        for shard, seconds in sorted(self._shard_seconds.items()):
            for second in [s for s in seconds if s < last - 10]:
                del seconds[second]  # keep a few seconds, not the whole run
            records = stored = 0
            for second in range(last - window + 1, last + 1):
                row = seconds.get(second)
                if row:
                    records += row[0]
                    stored += row[1]
            span = max(1, min(window, last + 1))
            rates.append(
                ShardRate(shard, records / span, stored / span, 0, None, SHARD_BYTES_PER_SECOND)
            )
        return rates
