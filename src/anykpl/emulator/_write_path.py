"""The emulator's write path: PutRecord and PutRecords with the service's per-shard limits.

moto accepts any rate and routes records after a split to the closed parent shard (its
``Stream.get_shard_for_key`` walks closed shards too, in insertion order, and treats the ending
hash key as exclusive). This module replaces moto's write path and nothing else: it routes each
record to the **open** shard whose (inclusive) hash range holds its hash key, charges the shard's
token buckets, answers throttled records with ``ProvisionedThroughputExceededException`` in the
service's message format, rolls the per-record fault dice (``InternalFailure``, and throttles
whatever the rate), and appends stored records to moto's shard objects so that moto's
GetShardIterator and GetRecords read them back unchanged.

It is synchronous and clock-injected (``now`` is passed in), so the limits and routing are
tested without a server or an event loop; the HTTP server owns the only clock.
"""

from __future__ import annotations

import functools
import hashlib
import random
from base64 import b64decode
from bisect import bisect_left
from collections.abc import Iterable
from datetime import datetime, timezone
from typing import Any

from .._core._limits import (
    DEFAULT_MAX_RECORD_SIZE,
    MAX_HASH_KEY,
    MAX_PARTITION_KEY_LENGTH,
    PUT_RECORDS_MAX_RECORDS,
)
from ._options import Faults, Limits, Storm
from ._record_size import max_record_size, put_records_max_bytes

__all__ = ("RECORD_COUNTERS", "KinesisError", "ShardStats", "WritePath")

#: How many seconds of per-second statistics each shard keeps.
STATS_HISTORY_SECONDS = 300

#: what ``ShardStats.totals`` counts, in order
RECORD_COUNTERS = (
    "accepted_records",
    "accepted_bytes",
    "throttled_records",
    "throttled_bytes",
    "failed_records",
    # of the throttled records, those the ``record_throttle_rate`` dice chose
    "injected_throttled_records",
)

_INTERNAL_FAILURE = {"ErrorCode": "InternalFailure", "ErrorMessage": "Internal service failure."}


class KinesisError(Exception):
    """A whole-request error, answered as the service does: ``{"__type": ..., "message": ...}``
    with an HTTP status."""

    def __init__(self, status: int, error_type: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message

    def body(self) -> dict[str, str]:
        return {"__type": self.error_type, "message": self.message}


class ShardStats:
    """Counters for one shard: totals and one row per second of uptime."""

    __slots__ = ("per_second", "totals")

    def __init__(self) -> None:
        # accepted records, accepted bytes, throttled records, throttled bytes, failed records,
        # injected throttled records (``RECORD_COUNTERS``); a row keeps the first five
        self.totals = [0, 0, 0, 0, 0, 0]
        self.per_second: dict[int, list[int]] = {}

    def row(self, second: int) -> list[int]:
        row = self.per_second.get(second)
        if row is None:
            row = self.per_second[second] = [0, 0, 0, 0, 0]
            if len(self.per_second) > STATS_HISTORY_SECONDS:
                for old in sorted(self.per_second)[: len(self.per_second) - STATS_HISTORY_SECONDS]:
                    del self.per_second[old]
        return row


class _Bucket:
    """Records and bytes tokens of one shard. Capacity is one second of the rate in force (the
    service's limits are per second). A record of up to 1 MiB needs its size in tokens, so one
    bigger than the byte capacity during a storm is throttled until the storm ends. A larger
    one (a stream whose maximum record size was raised) goes through once the bucket is full
    and leaves it in debt: the service's burst for large records (``_record_size``); during a
    storm it waits for the storm's end, as the smaller ones do."""

    __slots__ = ("bytes", "records", "updated")

    def __init__(self, records: float, nbytes: float, now: float) -> None:
        self.records = records
        self.bytes = nbytes
        self.updated = now

    def try_take(self, size: int, records_rate: float, bytes_rate: float, now: float) -> bool:
        elapsed = now - self.updated
        if elapsed > 0:
            self.records = min(records_rate, self.records + elapsed * records_rate)
            self.bytes = min(bytes_rate, self.bytes + elapsed * bytes_rate)
            self.updated = now
        else:
            # a storm that just started cuts the capacity at once
            self.records = min(self.records, records_rate)
            self.bytes = min(self.bytes, bytes_rate)
        # a large record waits for a full bucket of a shard not cut by a storm (a storm cuts
        # the rate below 1 MiB/s): during one it waits, as a smaller record too big for the
        # cut bucket does
        need = (
            size
            if size <= DEFAULT_MAX_RECORD_SIZE or bytes_rate < DEFAULT_MAX_RECORD_SIZE
            else min(size, bytes_rate)
        )
        if self.records >= 1.0 and self.bytes >= need:
            self.records -= 1.0
            self.bytes -= size
            return True
        return False


def _decoded_length(data: str) -> int:
    """The length of base64 ``data`` once decoded, without decoding it."""
    n = len(data)
    if n % 4:
        raise KinesisError(400, "SerializationException", "Data is not valid base64.")
    padding = 2 if data.endswith("==") else 1 if data.endswith("=") else 0
    return n // 4 * 3 - padding


_HASH_KEY_DIGITS = len(str(MAX_HASH_KEY))


def _explicit_hash_key(explicit: Any) -> int:
    """An ExplicitHashKey's value: a decimal in [0, 2**128 - 1], else the service's 400.

    The digit count is checked before ``int()``: Python refuses to convert more than 4,300
    digits with a ValueError, which would have been answered 500.
    """
    if isinstance(explicit, str) and explicit.isascii() and explicit.isdigit():
        digits = explicit.lstrip("0")
        if len(digits) <= _HASH_KEY_DIGITS and int(digits or "0") <= MAX_HASH_KEY:
            return int(digits or "0")
    shown = explicit if len(str(explicit)) <= 100 else f"{str(explicit)[:100]}..."
    raise KinesisError(
        400,
        "InvalidArgumentException",
        f"Invalid ExplicitHashKey. ExplicitHashKey must be in the range: [0, {MAX_HASH_KEY}]. "
        f"Specified value was {shown}",
    )


class WritePath:
    """Routes, limits, counts and stores records; one per emulator."""

    def __init__(self, limits: Limits, faults: Faults, now: float) -> None:
        self.limits = limits
        self.faults = faults
        self.random = random.Random(faults.seed)
        self.started = now
        self.storms: list[tuple[float, float, Storm]] = []
        self.stats: dict[tuple[str, str], ShardStats] = {}
        #: request-level counters; the record counters are summed from ``stats`` (``totals``)
        self.requests = {"requests": 0, "request_errors": 0, "resets": 0, "cbor_requests": 0}
        self._buckets: dict[tuple[str, str], _Bucket] = {}

    # -- control -----------------------------------------------------------------------------

    def set_faults(self, faults: Faults) -> None:
        self.faults = faults
        if faults.seed is not None:
            self.random.seed(faults.seed)

    def set_limits(self, limits: Limits) -> None:
        self.limits = limits

    def add_storm(self, storm: Storm, now: float) -> None:
        start = now + storm.start
        self.storms.append((start, start + storm.duration, storm))

    def reset_stats(self) -> None:
        self.stats.clear()
        for key in self.requests:
            self.requests[key] = 0

    @property
    def totals(self) -> dict[str, int]:
        """Every counter: the request-level ones and the shards' record counters summed."""
        sums = [0] * len(RECORD_COUNTERS)
        for shard in self.stats.values():
            for index, value in enumerate(shard.totals):
                sums[index] += value
        return {**self.requests, **dict(zip(RECORD_COUNTERS, sums, strict=True))}

    def limit_factor(self, stream: str, shard_id: str, now: float) -> float:
        """The storm factor in force for a shard now (1.0 outside storms)."""
        factor = 1.0
        if self.storms:
            self.storms = [s for s in self.storms if s[1] > now]
            for start, _end, storm in self.storms:
                if start <= now and storm.stream == stream and storm.shard_id in (None, shard_id):
                    factor = min(factor, storm.factor)
        return factor

    def shard_limits(self, stream: str, shard_id: str, now: float) -> tuple[float, float] | None:
        """(records/s, bytes/s) in force for a shard, or None when limits are off."""
        if not self.limits.enabled:
            return None
        factor = self.limit_factor(stream, shard_id, now)
        return (self.limits.records_per_second * factor, self.limits.bytes_per_second * factor)

    def shard_stats(self, stream: str, shard_id: str) -> ShardStats:
        key = (stream, shard_id)
        stats = self.stats.get(key)
        if stats is None:
            stats = self.stats[key] = ShardStats()
        return stats

    # -- the write path ----------------------------------------------------------------------

    def put_records(self, stream: Any, account_id: str, entries: Any, now: float) -> dict[str, Any]:
        """Handle one PutRecords request for moto's ``stream``; returns the response body."""
        if not isinstance(entries, list) or not entries:
            raise KinesisError(
                400,
                "ValidationException",
                "1 validation error detected: Value at 'records' failed to satisfy constraint: "
                "Member must have length greater than or equal to 1",
            )
        if len(entries) > PUT_RECORDS_MAX_RECORDS:
            raise KinesisError(
                400,
                "ValidationException",
                f"1 validation error detected: Value at 'records' failed to satisfy constraint: "
                f"Member must have length less than or equal to {PUT_RECORDS_MAX_RECORDS}",
            )
        limit = max_record_size(stream)
        prepared = [self._prepare(entry, index, limit) for index, entry in enumerate(entries)]
        request_limit = put_records_max_bytes(stream)
        if sum(p[3] for p in prepared) > request_limit:
            raise KinesisError(
                400,
                "InvalidArgumentException",
                f"Records size exceeds {request_limit // (1024 * 1024)} MB limit",
            )
        results = self._write(stream, account_id, prepared, now)
        failed = sum(1 for r in results if "ErrorCode" in r)
        return {"FailedRecordCount": failed, "Records": results, "EncryptionType": "NONE"}

    def put_record(self, stream: Any, account_id: str, entry: Any, now: float) -> dict[str, Any]:
        """Handle one PutRecord request; a throttled or failed record is a request error."""
        prepared = self._prepare(entry, 0, max_record_size(stream))
        result = self._write(stream, account_id, [prepared], now)[0]
        code = result.get("ErrorCode")
        if code == "ProvisionedThroughputExceededException":
            raise KinesisError(400, code, result["ErrorMessage"])
        if code is not None:
            raise KinesisError(500, code, result["ErrorMessage"])
        return {**result, "EncryptionType": "NONE"}

    def _prepare(self, entry: Any, index: int, limit: int) -> tuple[str, str, int, int]:
        """Validate one entry (``limit``: its stream's maximum record size); returns
        (partition key, base64 data, hash key, size)."""
        if not isinstance(entry, dict):
            raise KinesisError(400, "SerializationException", f"record {index} is not an object")
        key = entry.get("PartitionKey")
        data = entry.get("Data")
        if not isinstance(key, str) or not 1 <= len(key) <= MAX_PARTITION_KEY_LENGTH:
            raise KinesisError(
                400,
                "ValidationException",
                f"1 validation error detected: Value at 'records.{index + 1}.member.partitionKey'"
                f" failed to satisfy constraint: Member must have length between 1 and "
                f"{MAX_PARTITION_KEY_LENGTH}",
            )
        if not isinstance(data, str):
            raise KinesisError(400, "SerializationException", f"record {index} has no Data")
        size = _decoded_length(data) + len(key.encode("utf-8"))
        if size > limit:
            raise KinesisError(
                400,
                "ValidationException",
                f"1 validation error detected: Value at 'records.{index + 1}.member.data' failed "
                f"to satisfy constraint: Member must have length less than or equal to "
                f"{limit}",
            )
        explicit = entry.get("ExplicitHashKey")
        if explicit is not None:
            hash_key = _explicit_hash_key(explicit)
        else:
            hash_key = int.from_bytes(hashlib.md5(key.encode("utf-8")).digest(), "big")
        return key, data, hash_key, size

    def _write(
        self,
        stream: Any,
        account_id: str,
        prepared: Iterable[tuple[str, str, int, int]],
        now: float,
    ) -> list[dict[str, str]]:
        from moto.kinesis.models import Record

        holds_bytes = _record_holds_bytes(Record)
        open_shards = sorted(
            (s for s in stream.shards.values() if s.is_open), key=lambda s: s.starting_hash
        )
        ends = [s.ending_hash for s in open_shards]
        stream_name: str = stream.stream_name
        faults = self.faults
        dice = self.random.random
        second = int(now - self.started)
        arrival = datetime.now(timezone.utc).replace(tzinfo=None)
        arrival_seconds = arrival.replace(tzinfo=timezone.utc).timestamp()
        # per shard in this request: (bucket, rates, stats, row, next sequence number)
        per_shard: dict[str, list[Any]] = {}
        results: list[dict[str, str]] = []
        for key, data, hash_key, size in prepared:
            shard = open_shards[bisect_left(ends, hash_key)]
            shard_id: str = shard.shard_id
            state = per_shard.get(shard_id)
            if state is None:
                rates = self.shard_limits(stream_name, shard_id, now)
                bucket = None
                if rates is not None:
                    bucket = self._buckets.get((stream.arn, shard_id))
                    if bucket is None:
                        bucket = self._buckets[(stream.arn, shard_id)] = _Bucket(*rates, now)
                stats = self.shard_stats(stream_name, shard_id)
                records = shard.records
                next_sequence = next(reversed(records)) + 1 if records else 1
                state = per_shard[shard_id] = [
                    bucket,
                    rates,
                    stats,
                    stats.row(second),
                    records,
                    next_sequence,
                ]
            bucket, rates, stats, row, records, sequence = state
            # one roll per record for both per-record faults: a failure below
            # record_failure_rate, an injected throttle in the next record_throttle_rate
            injected_throttle = False
            if faults.record_failure_rate or faults.record_throttle_rate:
                roll = dice()
                if roll < faults.record_failure_rate:
                    stats.totals[4] += 1
                    row[4] += 1
                    results.append(_INTERNAL_FAILURE)
                    continue
                injected_throttle = roll < faults.record_failure_rate + faults.record_throttle_rate
            # an injected throttle is answered and counted as a limit throttle, and like one
            # costs no tokens
            if injected_throttle or (
                bucket is not None and not bucket.try_take(size, rates[0], rates[1], now)
            ):
                stats.totals[2] += 1
                stats.totals[3] += size
                row[2] += 1
                row[3] += size
                if injected_throttle:
                    stats.totals[5] += 1
                results.append(
                    {
                        "ErrorCode": "ProvisionedThroughputExceededException",
                        "ErrorMessage": f"Rate exceeded for shard {shard_id} in stream "
                        f"{stream_name} under account {account_id}.",
                    }
                )
                continue
            # moto's Record, filled in directly: one timestamp per request, no per-record clock
            record: Any = Record.__new__(Record)
            record.partition_key = key
            record.sequence_number = sequence
            record.explicit_hash_key = None
            if holds_bytes:
                record.data = b64decode(data)
                record.created_at = arrival
            else:
                record.data = data
                record.created_at_datetime = arrival
                record.created_at = arrival_seconds
            records[sequence] = record
            state[5] = sequence + 1
            stats.totals[0] += 1
            stats.totals[1] += size
            row[0] += 1
            row[1] += size
            results.append({"SequenceNumber": str(sequence), "ShardId": shard_id})
        return results


@functools.cache
def _record_holds_bytes(record_class: Any) -> bool:
    """Whether moto's kinesis ``Record`` holds its data as bytes and its arrival as a datetime
    (``created_at``: moto 5.2.6 on), rather than as base64 text with the arrival both as a
    datetime (``created_at_datetime``) and in seconds (``created_at``: moto up to 5.2.5). The
    write path fills moto's records in directly, so it must fill them as moto reads them (asked
    once per class)."""
    return not hasattr(record_class("key", b"", 1, None), "created_at_datetime")
