"""The Retrier: classify every PutRecords outcome, resolve results, send retries back.

Mirrors aws/kinesis/core/retrier.{h,cc}:

- a failed request fails or retries every record in it; a response whose entry count differs
  from the request fails every record with ``Record Count Mismatch``;
- a per-record error retries the Kinesis record's user records, except throttling when
  ``fail_if_throttled`` is set;
- a retried record gets the attempt, then — if its TTL has passed — a final ``Expired``
  attempt; otherwise a new deadline of ``now + RMBT/2`` (clamped to its expiration) and it goes
  back to the aggregator, which re-predicts its shard and re-aggregates it;
- wrong-shard detection (``succeed_if_correct_shard``): a record that landed in a shard other
  than the predicted one is fine only if its hash key lies in the actual shard's range; else the
  shard map is invalidated (once per Kinesis record) and the record retried as ``Wrong Shard``.

Where we differ, and why:

- **Fail fast**: codes that a retry cannot fix (missing stream, access, validation, KMS access;
  :func:`anykpl.errors.is_retriable`) fail at once instead of retrying until the TTL.
- **Backoff**: retries wait an exponential backoff with full jitter per shard
  (``retry_backoff_initial`` doubling to ``retry_backoff_max``, reset by a success on that
  shard) before re-entering the aggregator. The KPL re-sends after RMBT/2 at most (KPL #35).
  Wrong Shard is not backed off: the refreshed map is the fix.
- **All-or-nothing aggregates**: after KPL #576 the KPL accepts the user records of a
  wrong-shard aggregate whose own keys fall in the actual shard, but a KCL consumer drops the
  *whole* aggregate when any sub-record is out of range. We count an aggregate as delivered only
  if **all** its sub-records lie in the actual shard's range; otherwise all are retried.
"""

from __future__ import annotations

import heapq
import logging
import math
import random
from collections.abc import Callable, Sequence

from . import errors
from ._records import KinesisRecord, PendingRecord, _AttemptRecord
from ._sender import Outcome
from ._shard_map import ShardMap, shard_number

__all__ = ("Retrier",)

logger = logging.getLogger("anykpl.retrier")

Finish = Callable[[Sequence[PendingRecord], bool], None]
Count = Callable[[str, int, str | None, str | None], None]
#: (name, shard, error code, count, sum, min, max): a statistic set for the metrics
Observe = Callable[[str, str | None, str | None, float, float, float, float], None]


class Retrier:
    """Per-stream outcome handling. Pure apart from the random jitter: the caller passes times
    and moves the retries (see :meth:`take_due`)."""

    def __init__(
        self,
        *,
        stream: str,
        shard_map: ShardMap,
        finish: Finish,
        count: Count,
        request_refresh: Callable[[], None],
        record_max_buffered_time: float,
        fail_if_throttled: bool,
        backoff_initial: float,
        backoff_max: float,
        rng: random.Random | None = None,
        observe: Observe | None = None,
    ) -> None:
        self.stream = stream
        self.shard_map = shard_map
        self.finish = finish
        self.count = count
        self.observe = observe
        self.request_refresh = request_refresh
        self.retry_delay = record_max_buffered_time / 2
        self.fail_if_throttled = fail_if_throttled
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.rng = rng or random.Random()
        self._streaks: dict[str | None, int] = {}
        # shards whose streak this outcome already advanced: one failed request with twenty
        # Kinesis records for a shard is one step of backoff, not twenty
        self._advanced: set[str | None] = set()
        self._delayed: list[tuple[float, int, list[PendingRecord]]] = []
        # records failed for good while handling one outcome: code -> (count, a message)
        self._failed: dict[str, tuple[int, str]] = {}
        self._counter = 0
        self.delayed_records = 0

    # -- outcomes -----------------------------------------------------------------------

    def handle(self, outcome: Outcome, now: float) -> None:
        try:
            self._handle(outcome, now)
        finally:
            if self._failed:
                self._log_failures()

    def _log_failures(self) -> None:
        """One log line per error code for the records that just failed for good: never one
        per record, and nothing for records that will be retried."""
        for code, (count, message) in self._failed.items():
            if code == errors.EXPIRED:
                logger.warning(
                    "%d user record(s) of stream %s expired (record_ttl): %s",
                    count,
                    self.stream,
                    message,
                    extra={"stream": self.stream, "error_code": code, "records": count},
                )
            else:
                logger.warning(
                    "%d user record(s) of stream %s failed: %s: %s",
                    count,
                    self.stream,
                    code,
                    message,
                    extra={"stream": self.stream, "error_code": code, "records": count},
                )
        self._failed.clear()

    def _handle(self, outcome: Outcome, now: float) -> None:
        self._advanced.clear()
        records: Sequence[KinesisRecord] = outcome.records
        if self.observe is not None:
            self._observe_request(outcome)
        if outcome.response is None:
            code = outcome.error_code or "UnknownError"
            message = outcome.error_message or ""
            self.count("ErrorsByCode", 1, None, code)
            self.count("AllErrors", 1, None, None)
            attempt = _AttemptRecord(outcome.start, outcome.end, False, code, message)
            for kr in records:
                self._fail_or_retry(kr, attempt, now)
            return
        entries = outcome.response.get("Records", [])
        if len(entries) != len(records):
            attempt = _AttemptRecord(
                outcome.start,
                outcome.end,
                False,
                errors.RECORD_COUNT_MISMATCH,
                f"sent {len(records)} records, the response has {len(entries)}",
            )
            for kr in records:
                self._fail(kr.records, attempt)
            return
        succeeded = failed = 0
        put_bytes, smallest, largest = 0, math.inf, 0
        for kr, entry in zip(records, entries, strict=True):
            sequence_number = entry.get("SequenceNumber")
            if sequence_number is None:
                failed += 1
                code = entry.get("ErrorCode") or "UnknownError"
                self.count("ErrorsByCode", 1, kr.predicted_shard, code)
                attempt = _AttemptRecord(
                    outcome.start, outcome.end, False, code, entry.get("ErrorMessage") or ""
                )
                self._fail_or_retry(kr, attempt, now)
            else:
                succeeded += 1
                size = kr.size
                put_bytes += size
                if size < smallest:
                    smallest = size
                if size > largest:
                    largest = size
                self._succeed_if_correct_shard(kr, entry["ShardId"], sequence_number, outcome, now)
        self.count("KinesisRecordsPut", succeeded, None, None)
        if succeeded and self.observe is not None:
            self.observe(
                "KinesisRecordsDataPut", None, None, succeeded, put_bytes, smallest, largest
            )
        if failed:
            self.count("AllErrors", failed, None, None)

    def _observe_request(self, outcome: Outcome) -> None:
        """The per-request metrics, one statistic set each (see anykpl/_metrics.py)."""
        observe = self.observe
        assert observe is not None
        records: Sequence[KinesisRecord] = outcome.records
        start = outcome.start
        milliseconds = (outcome.end - start) * 1000
        observe("RequestTime", None, None, 1, milliseconds, milliseconds, milliseconds)
        if not records:
            return
        count = len(records)
        observe("KinesisRecordsPerPutRecordsRequest", None, None, 1, count, count, count)
        users = 0
        fewest = most = len(records[0].records)
        longest, shortest, waited = 0.0, math.inf, 0.0
        for kr in records:
            n = len(kr.records)
            users += n
            if n < fewest:
                fewest = n
            elif n > most:
                most = n
            # BufferingTime, per Kinesis record: how long its oldest user record waited since
            # it arrived or its previous attempt ended (the KPL samples every user record)
            oldest = kr.records[0]
            last = oldest._last_attempt
            wait = (start - (oldest.arrival if last is None else last.end)) * 1000
            waited += wait
            if wait > longest:
                longest = wait
            if wait < shortest:
                shortest = wait
        observe("UserRecordsPerPutRecordsRequest", None, None, 1, users, users, users)
        observe("UserRecordsPerKinesisRecord", None, None, count, users, fewest, most)
        observe("BufferingTime", None, None, count, waited, shortest, longest)

    def _succeed_if_correct_shard(
        self,
        kr: KinesisRecord,
        actual: str,
        sequence_number: str,
        outcome: Outcome,
        now: float,
    ) -> None:
        predicted = kr.predicted_shard
        if predicted is not None and predicted != actual:
            hash_range = self.shard_map.hash_range(actual)
            if hash_range is None or any(
                not (hash_range[0] <= r.hash_key <= hash_range[1]) for r in kr.records
            ):
                logger.warning(
                    "Kinesis record predicted for %s landed in %s; this usually means the "
                    "shard map has changed",
                    predicted,
                    actual,
                    extra={"stream": self.stream, "predicted": predicted, "actual": actual},
                )
                if self.shard_map.invalidate(outcome.start, predicted):
                    self.request_refresh()
                attempt = _AttemptRecord(
                    outcome.start,
                    outcome.end,
                    False,
                    errors.WRONG_SHARD,
                    f"record did not end up in expected shard {predicted} (landed in {actual})",
                )
                self.count("ErrorsByCode", 1, predicted, errors.WRONG_SHARD)
                self._retry(kr.records, attempt, now, backoff_key=None, backoff=False)
                return
            # landed in a child shard: the map is stale, help it converge
            if shard_number(predicted) < shard_number(actual) and self.shard_map.invalidate(
                outcome.start, predicted
            ):
                self.request_refresh()
        attempt = _AttemptRecord(outcome.start, outcome.end, True, None, None)
        for index, record in enumerate(kr.records):
            record._add_attempt(attempt)
            record.shard_id = actual
            record.sequence_number = sequence_number
            record.sub_sequence_number = index
        self._streaks.pop(predicted, None)
        self.count("UserRecordsPut", len(kr.records), actual, None)
        if self.observe is not None:
            sizes = [len(record.data) for record in kr.records]
            self.observe(
                "UserRecordsDataPut", actual, None, len(sizes), sum(sizes), min(sizes), max(sizes)
            )
        self.finish(kr.records, True)

    def _fail_or_retry(self, kr: KinesisRecord, attempt: _AttemptRecord, now: float) -> None:
        code = attempt.code or ""
        if not errors.is_retriable(code) or (self.fail_if_throttled and code == errors.THROTTLED):
            self._fail(kr.records, attempt)
        else:
            self._retry(kr.records, attempt, now, backoff_key=kr.predicted_shard, backoff=True)

    def _fail(self, records: Sequence[PendingRecord], attempt: _AttemptRecord) -> None:
        for record in records:
            record._add_attempt(attempt)
        code = attempt.code or "UnknownError"
        seen = self._failed.get(code)
        self._failed[code] = ((seen[0] if seen else 0) + len(records), attempt.message or "")
        if attempt.code == errors.EXPIRED:
            self.count("UserRecordExpired", len(records), None, None)
        self.count("UserRecordsFailed", len(records), None, attempt.code)
        self.finish(records, False)

    def expire(self, records: Sequence[KinesisRecord], now: float) -> None:
        """Fail Kinesis records whose TTL passed while they waited in the limiter."""
        attempt = _AttemptRecord(
            now, now, False, errors.EXPIRED, "Expiration reached while waiting in limiter"
        )
        for kr in records:
            self._fail(kr.records, attempt)
        self._log_failures()

    def _retry(
        self,
        records: Sequence[PendingRecord],
        attempt: _AttemptRecord,
        now: float,
        *,
        backoff_key: str | None,
        backoff: bool,
    ) -> None:
        expired_attempt: _AttemptRecord | None = None
        retry: list[PendingRecord] = []
        expired: list[PendingRecord] = []
        for record in records:
            record._add_attempt(attempt)
            if record.expiration < now:
                expired.append(record)
            else:
                retry.append(record)
        if expired:
            expired_attempt = _AttemptRecord(
                now, now, False, errors.EXPIRED, "Record has reached expiration"
            )
            self._fail(expired, expired_attempt)
        if not retry:
            return
        self.count("RetriesPerRecord", len(retry), backoff_key, None)
        delay = 0.0
        if backoff:
            streak = self._streaks.get(backoff_key, 0)
            if backoff_key in self._advanced:
                streak -= 1  # the step this outcome already took
            else:
                self._advanced.add(backoff_key)
                self._streaks[backoff_key] = streak + 1
            cap = min(self.backoff_max, self.backoff_initial * (2.0**streak))
            delay = self.rng.uniform(0.0, cap)
        release = now + delay
        deadline = release + self.retry_delay
        for record in retry:
            record.deadline = deadline if deadline < record.expiration else record.expiration
        self._counter += 1
        heapq.heappush(self._delayed, (release, self._counter, retry))
        self.delayed_records += len(retry)

    # -- the retry queue ------------------------------------------------------------------

    @property
    def next_release(self) -> float:
        return self._delayed[0][0] if self._delayed else math.inf

    def take_due(self, now: float) -> list[PendingRecord]:
        """The retried records whose backoff has passed."""
        due: list[PendingRecord] = []
        while self._delayed and self._delayed[0][0] <= now:
            due.extend(heapq.heappop(self._delayed)[2])
        self.delayed_records -= len(due)
        return due

    def take_all(self) -> list[PendingRecord]:
        records = [r for item in self._delayed for r in item[2]]
        self._delayed.clear()
        self.delayed_records = 0
        return records
