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
a record larger than the request limit goes out alone.
"""

from __future__ import annotations

import math

from . import _limits
from ._records import KinesisRecord

__all__ = ("Collector",)

COLLECTOR_EXTENSION_CAP = 0.05
COLLECTOR_EXTENSION_RATIO = 0.2


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
        self.deadline = math.inf

    def __repr__(self) -> str:
        return f"<Collector {len(self._records)} record(s) {self._size} bytes>"

    def __len__(self) -> int:
        return len(self._records)

    def put(self, records: list[KinesisRecord], now: float, out: list[list[KinesisRecord]]) -> None:
        """Add ``records``; append any full requests to ``out``."""
        floor = now + self.extension
        shard_limit = _limits.COLLECTOR_SHARD_FLUSH_BYTES
        for kr in records:
            if self._records and (
                len(self._records) >= self.max_count or self._size + kr.size > self.max_size
            ):
                out.append(self._take())
            self._records.append(kr)
            self._size += kr.size
            deadline = kr.deadline if kr.deadline > floor else floor
            if deadline > kr.expiration:
                deadline = kr.expiration
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
        self.deadline = math.inf
        return records
