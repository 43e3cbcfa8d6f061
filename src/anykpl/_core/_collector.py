"""The Collector: Kinesis records → PutRecords requests, one open request per stream.

Mirrors aws/kinesis/core/collector.h and put_records_request.h, the Reducer's second use:

- a request holds at most ``collection_max_count`` (≤ 500) records and
  ``collection_max_size`` bytes, counted as Σ (partition key + data) — how the service counts
  its 5 MiB — and never mixes streams;
- it goes out when a limit is reached, when any one shard has 256 KiB buffered in it (to keep
  per-shard traffic smooth), or when the earliest deadline among its records passes;
- with aggregation on, a record's deadline is first pushed to at least
  ``now + min(50 ms, 0.2 × RMBT)`` so records that spent their whole buffer time in the
  aggregator still get a moment to share a request (KPL PR #280).

Where we differ: like the aggregator, the size limit is checked before adding (the request is
sent first if the record would not fit), which bounds it without the Reducer's sort-and-trim;
a record larger than the request limit goes out alone. With adaptive batching, the pipeline
sends the open request as soon as nothing of the stream is in flight, unless it holds a
firehose's full aggregates: then it lingers up to the fill horizon (:meth:`Collector.linger`,
docs/batching.md).
"""

from __future__ import annotations

import math

from . import _limits
from ._records import KinesisRecord

__all__ = ("Collector",)

COLLECTOR_EXTENSION_CAP = 0.05
COLLECTOR_EXTENSION_RATIO = 0.2
#: seconds over which the pace of the records put is measured (two such windows)
PACE_WINDOW = 0.05
#: a lingering request goes when nothing came for this many times the mean time between its
#: records
LINGER_GAPS = 4.0


class Collector:
    """Per-stream request batching state. Pure: the caller passes times and moves output."""

    def __init__(
        self,
        *,
        max_count: int,
        max_size: int,
        record_max_buffered_time: float,
        extend_deadlines: bool,
    ) -> None:
        self.max_count = max_count
        self.max_size = max_size
        self.extension = (
            min(COLLECTOR_EXTENSION_CAP, COLLECTOR_EXTENSION_RATIO * record_max_buffered_time)
            if extend_deadlines
            else 0.0
        )
        self._records: list[KinesisRecord] = []
        self._size = 0
        self._shard_bytes: dict[str | None, int] = {}
        # when the open request goes at the latest: its records' earliest deadline (``_due``),
        # or sooner while it lingers (``linger``)
        self.deadline = math.inf
        self._due = math.inf
        # when the open request took its first record, and its latest
        self._first_at = math.inf
        self._last_at = -math.inf
        # the pace records come at (see pace): the bytes put since the current window of
        # PACE_WINDOW seconds started (those put at its start not counted), and the pace over
        # the window before it
        self._window_start = -math.inf
        self._window_bytes = 0
        self._previous_pace = 0.0

    def __repr__(self) -> str:
        return f"<Collector {len(self._records)} record(s) {self._size} bytes>"

    def __len__(self) -> int:
        return len(self._records)

    def put(self, records: list[KinesisRecord], now: float, out: list[list[KinesisRecord]]) -> None:
        """Add ``records``; append any full requests to ``out``."""
        floor = now + self.extension
        shard_limit = _limits.COLLECTOR_SHARD_FLUSH_BYTES
        # records put at the start of a window are not counted in its pace
        counted = now < self._window_start + PACE_WINDOW
        if not counted:
            # a new window, from these records; the one before counts if it was just before
            if now < self._window_start + 2 * PACE_WINDOW:
                self._previous_pace = self._window_bytes / (now - self._window_start)
            else:
                self._previous_pace = 0.0
            self._window_start = now
            self._window_bytes = 0
        for kr in records:
            if counted:
                self._window_bytes += kr.size
            if self._records and (
                len(self._records) >= self.max_count or self._size + kr.size > self.max_size
            ):
                out.append(self._take())
            if not self._records:
                self._first_at = now
            self._last_at = now
            self._records.append(kr)
            self._size += kr.size
            deadline = kr.deadline if kr.deadline > floor else floor
            if deadline > kr.expiration:
                deadline = kr.expiration
            if deadline < self._due:
                self._due = deadline
                if deadline < self.deadline:
                    self.deadline = deadline
            shard = kr.predicted_shard
            buffered = self._shard_bytes.get(shard, 0) + kr.size
            self._shard_bytes[shard] = buffered
            if (
                buffered >= shard_limit
                or len(self._records) >= self.max_count
                or self._size >= self.max_size
            ):
                out.append(self._take())

    def pace(self, now: float) -> float:
        """Bytes per second put lately: since the current window started, with the window
        before it (each ``PACE_WINDOW`` seconds) if that one was just before."""
        span = now - self._window_start
        if span >= 2 * PACE_WINDOW:
            return 0.0
        if span <= 0.0:
            return self._previous_pace
        if self._previous_pace:
            return (self._window_bytes + self._previous_pace * PACE_WINDOW) / (span + PACE_WINDOW)
        return self._window_bytes / span

    def linger(self, now: float, horizon: float, aggregate_size: int) -> bool:
        """Whether the open request, which nothing in flight could carry, should keep
        gathering instead of going now: while records come as a firehose's do, full
        aggregates (on average at least half of ``aggregate_size``, where a service's records
        go in the small aggregates its round trips seal) at a pace that would put two of
        them in it within ``horizon``; for at most ``horizon`` after its first record, and for
        at most ``LINGER_GAPS`` times the mean time between records after its latest (a burst
        that ends goes soon after). A limit or a deadline still sends it sooner. Sets
        :attr:`deadline` to when it goes if nothing more comes."""
        count = len(self._records)
        if not count or 2 * self._size < count * aggregate_size:
            return False
        pace = self.pace(now)
        if pace * horizon < 2 * aggregate_size:
            return False
        until = self._first_at + horizon
        # the mean time between records, at the pace as of the latest (not one that falls
        # while nothing comes)
        latest_pace = self.pace(self._last_at)
        gap = LINGER_GAPS * self._size / count / (latest_pace if latest_pace > 0.0 else pace)
        if self._last_at + gap < until:
            until = self._last_at + gap
        if until <= now:
            return False
        self.deadline = until if until < self._due else self._due
        return True

    def flush_due(self, now: float, out: list[list[KinesisRecord]]) -> None:
        if self._records and self.deadline <= now:
            out.append(self._take())

    def flush(self, out: list[list[KinesisRecord]]) -> None:
        if self._records:
            out.append(self._take())

    def _take(self) -> list[KinesisRecord]:
        records = self._records
        self._records = []
        self._size = 0
        self._shard_bytes.clear()
        self.deadline = self._due = math.inf
        self._first_at = math.inf
        return records
