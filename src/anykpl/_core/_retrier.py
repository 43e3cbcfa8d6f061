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
- **Adaptive control**: each response is reported to the Limiter once per predicted shard
  (``on_outcome``: records sent, throttled, accepted), where it steers that shard's rate
  (``_adaptive.py``).
- **Retry budget**: retries spend from a per-stream budget refilled by successes
  (:class:`RetryBudget`); once it is spent, failed records wait ``retry_backoff_max`` before
  they retry, so a storm of failures cannot multiply the traffic. Nothing is failed for it.
- **A shard the map has not seen**: an aggregate of several keys that lands in a shard the
  map does not know yet (a child of a split, under load) waits for the refresh that shows the
  shard's range, then is delivered or retried by it; the KPL retries it at once, which stores a
  second copy of every sub-record that was in range. A raw record, or an aggregate of one key,
  is where the service routed it, known shard or not.
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Final

from .. import errors
from ._records import PENDING, AttemptRecord, KinesisRecord, Record
from ._shard_map import ShardMap, shard_number

__all__ = ("Outcome", "Retrier", "RetrierStatistics", "RetryBudget", "StatisticSet")

logger = logging.getLogger("anykpl.retrier")

Finish = Callable[[Sequence[Record], bool], None]
Count = Callable[[str, int, str | None, str | None], None]
#: (name, shard, error code, statistic set): what one outcome adds to a metric
Observe = Callable[[str, str | None, str | None, "StatisticSet"], None]

#: a user record's data
_data_of: Final = attrgetter("data")
#: (shard, Kinesis records sent, of them throttled, accepted records, accepted bytes, when
#: their request was sent, now): one call per predicted shard of a PutRecords response
ShardOutcome = Callable[[str, int, int, int, int, float, float], None]


@dataclass(frozen=True, slots=True)
class RetrierStatistics:
    """The Retrier of one stream (``Retrier.statistics``)."""

    throttled: Mapping[str, int]
    backoff_time: Mapping[str | None, float]
    delayed_records: int
    retry_budget_exhausted: int


class Outcome:
    """One PutRecords call: the request's records, its timing, and the response or error."""

    __slots__ = ("end", "error_code", "error_message", "records", "response", "start", "stream")

    def __init__(
        self,
        stream: str,
        records: Sequence[Any],
        start: float,
        end: float,
        response: Mapping[str, Any] | None,
        error_code: str | None = None,
        error_message: str | None = None,
    ) -> None:
        self.stream = stream
        self.records = records
        self.start = start
        self.end = end
        self.response = response
        self.error_code = error_code
        self.error_message = error_message


class StatisticSet:
    """``count`` samples summing to ``total``, between ``minimum`` and ``maximum``: what one
    outcome adds to a metric, merged into the metrics' own statistic sets (the KPL's
    ``StatisticSet``; see ``_metrics.py``, "Counting per batch"). Mutable: the Retrier fills
    one per shard as it goes through a response's records, updating the fields inline (once
    per record, a method call would cost more than the update)."""

    __slots__ = ("count", "maximum", "minimum", "total")

    def __init__(self, count: float, total: float, minimum: float, maximum: float) -> None:
        self.count = count
        self.total = total
        self.minimum = minimum
        self.maximum = maximum

    def __repr__(self) -> str:
        return (
            f"StatisticSet(count={self.count!r}, total={self.total!r}, "
            f"minimum={self.minimum!r}, maximum={self.maximum!r})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StatisticSet):
            return NotImplemented
        return (self.count, self.total, self.minimum, self.maximum) == (
            other.count,
            other.total,
            other.minimum,
            other.maximum,
        )

    __hash__ = None  # type: ignore[assignment]  # mutable

    @classmethod
    def sample(cls, value: float) -> StatisticSet:
        """One sample of ``value``."""
        return cls(1, value, value, value)


class _ShardResponse:
    """What one response did for the Kinesis records predicted for a shard: the sizes of
    those delivered, and how many failed."""

    __slots__ = ("delivered", "failed")

    def __init__(self) -> None:
        self.delivered = StatisticSet(0, 0, math.inf, 0)
        self.failed = 0


class _RequestShard:
    """The Kinesis records of one request predicted for a shard: how many user records each
    carries, and how long each waited (its oldest user record, in milliseconds)."""

    __slots__ = ("buffering", "user_records")

    def __init__(self, users: int, wait: float) -> None:
        self.user_records = StatisticSet(1, users, users, users)
        self.buffering = StatisticSet(1, wait, wait, wait)


class RetryBudget:
    """Retries allowed as a share of successes, like Finagle's retry budget and botocore's
    retry quota. The unit is a shard's part of one PutRecords outcome: each outcome that
    delivered Kinesis records for a shard deposits ``ratio`` tokens, each outcome whose
    records for a shard are retried spends one (however many records that is: a failed
    request of 500 records is one retry, as botocore counts it), and ``minimum`` tokens arrive
    per second whatever the traffic. The balance holds at most ``capacity`` (botocore's retry
    quota starts at 500) and starts full. Pure: the caller passes the time."""

    __slots__ = ("balance", "capacity", "exhausted", "minimum", "ratio", "updated")

    def __init__(
        self, ratio: float, now: float, *, minimum: float = 10.0, capacity: float = 500.0
    ) -> None:
        self.ratio = ratio
        self.minimum = minimum
        self.capacity = capacity
        self.balance = capacity
        self.updated = now
        self.exhausted = 0  # retries that found the budget spent

    def deposit(self, delivered: float) -> None:
        balance = self.balance + self.ratio * delivered
        self.balance = balance if balance < self.capacity else self.capacity

    def try_spend(self, now: float) -> bool:
        elapsed = now - self.updated
        if elapsed > 0:
            self.balance = min(self.capacity, self.balance + self.minimum * elapsed)
            self.updated = now
        if self.balance >= 1.0:
            self.balance -= 1.0
            return True
        self.exhausted += 1
        return False


class _Held:
    """A Kinesis record stored in a shard the map does not know yet, with its response."""

    __slots__ = ("actual", "end", "kr", "needed", "sequence_number", "start")

    def __init__(
        self,
        kr: KinesisRecord,
        actual: str,
        sequence_number: str,
        start: float,
        end: float,
        needed: int,
    ) -> None:
        self.kr = kr
        self.actual = actual
        self.sequence_number = sequence_number
        self.start = start
        self.end = end
        # the map's update count at which it has been refreshed since this landed
        self.needed = needed


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
        on_outcome: ShardOutcome | None = None,
        retry_budget: RetryBudget | None = None,
        finish_items: Callable[[KinesisRecord], None] | None = None,
    ) -> None:
        self.stream = stream
        self.shard_map = shard_map
        self.finish = finish
        # a successful Kinesis record of column items counted out (StreamIntake.finish_items)
        self.finish_items = _no_column_items if finish_items is None else finish_items
        self.count = count
        self.observe = observe if observe is not None else _sums_only(count)
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
        self._delayed: list[tuple[float, int, list[Record]]] = []
        # outcomes stored in a shard the map has not seen (see _hold)
        self._held: list[_Held] = []
        # records failed for good while handling one outcome: code -> (count, a message)
        self._failed: dict[str, tuple[int, str]] = {}
        self._counter = 0
        self.delayed_records = 0
        self.on_outcome = on_outcome
        self.retry_budget = retry_budget
        # per shard, whether the budget paid for this outcome's retries
        self._budget_spent: dict[str | None, bool] = {}
        # throttled Kinesis records per predicted shard in the outcome being handled
        self._throttles: dict[str, int] = {}
        # per predicted shard, since the start: throttled Kinesis records, and user-record
        # seconds of retry backoff
        self.throttled: dict[str, int] = {}
        self.backoff_time: dict[str | None, float] = {}

    # -- outcomes -----------------------------------------------------------------------

    def handle(self, outcome: Outcome, now: float) -> None:
        try:
            self._handle(outcome, now)
        finally:
            if self._failed:
                self._log_failures()
            if self._throttles:
                throttled = self.throttled
                for shard, count in self._throttles.items():
                    throttled[shard] = throttled.get(shard, 0) + count
                self._throttles.clear()

    def _log_failures(self) -> None:
        """One log line per error code for the records that just failed for good: never one
        per record, and nothing for records that will be retried."""
        for code, (count, message) in self._failed.items():
            what = "expired (record_ttl)" if code == errors.EXPIRED else f"failed: {code}"
            logger.warning(
                "%d user record(s) of stream %s %s: %s",
                count,
                self.stream,
                what,
                message,
                extra={"stream": self.stream, "error_code": code, "records": count},
            )
        self._failed.clear()

    def _handle(self, outcome: Outcome, now: float) -> None:
        self._advanced.clear()
        self._budget_spent.clear()
        records: Sequence[KinesisRecord] = outcome.records
        self._observe_request(outcome)
        if outcome.response is None:
            code = outcome.error_code or "UnknownError"
            message = outcome.error_message or ""
            self.count("ErrorsByCode", 1, None, code)
            self.count("AllErrors", 1, None, None)
            attempt = AttemptRecord(outcome.start, outcome.end, False, code, message)
            for kr in records:
                self._fail_or_retry(kr, attempt, now)
            if self._throttles and self.on_outcome is not None:
                # a whole request throttled: every record in it was sent and throttled
                for throttled_shard, n in self._throttles.items():
                    self.on_outcome(throttled_shard, n, n, 0, 0, outcome.start, now)
            return
        entries = outcome.response.get("Records", [])
        if len(entries) != len(records):
            attempt = AttemptRecord(
                outcome.start,
                outcome.end,
                False,
                errors.RECORD_COUNT_MISMATCH,
                f"sent {len(records)} records, the response has {len(entries)}",
            )
            for kr in records:
                self._fail(kr.records, attempt, kr.predicted_shard)
            return
        # Per shard, one statistic set per metric for the whole response (see
        # anykpl/_core/_metrics.py): Kinesis records at their predicted shard, and the sizes of the
        # user records delivered at their actual shard.
        kinesis: dict[str | None, _ShardResponse] = {}
        users: dict[str, StatisticSet] = {}
        for kr, entry in zip(records, entries, strict=True):
            predicted = kr.predicted_shard
            response = kinesis.get(predicted)
            if response is None:
                response = kinesis[predicted] = _ShardResponse()
            sequence_number = entry.get("SequenceNumber")
            if sequence_number is None:
                response.failed += 1
                code = entry.get("ErrorCode") or "UnknownError"
                self.count("ErrorsByCode", 1, predicted, code)
                attempt = AttemptRecord(
                    outcome.start, outcome.end, False, code, entry.get("ErrorMessage") or ""
                )
                self._fail_or_retry(kr, attempt, now)
            else:
                delivered = response.delivered
                size = kr.size
                delivered.count += 1
                delivered.total += size
                if size < delivered.minimum:
                    delivered.minimum = float(size)
                if size > delivered.maximum:
                    delivered.maximum = float(size)
                self._succeed_if_correct_shard(
                    kr, entry["ShardId"], sequence_number, outcome, now, users
                )
        on_outcome = self.on_outcome
        if on_outcome is not None:
            # every shard's outcome, throttled or not: adaptive control learns from both
            throttles = self._throttles
            for predicted, response in kinesis.items():
                if predicted is not None:
                    delivered = response.delivered
                    accepted, accepted_bytes = int(delivered.count), int(delivered.total)
                    throttled = throttles.get(predicted, 0)
                    on_outcome(
                        predicted,
                        accepted + throttled,
                        throttled,
                        accepted,
                        accepted_bytes,
                        outcome.start,
                        now,
                    )
        observe = self.observe
        budget = self.retry_budget
        for shard, response in kinesis.items():
            delivered, failed = response.delivered, response.failed
            put = delivered.count
            if budget is not None and put:
                budget.deposit(1)
            # the KPL's 1 per delivered Kinesis record and 0 per failed one (and the reverse
            # for AllErrors): the zeros count as samples only
            count = put + failed
            low, high = (0.0 if failed else 1.0), (1.0 if put else 0.0)
            observe("KinesisRecordsPut", shard, None, StatisticSet(count, put, low, high))
            observe("AllErrors", shard, None, StatisticSet(count, failed, 1.0 - high, 1.0 - low))
            if put:
                observe("KinesisRecordsDataPut", shard, None, delivered)
        self._observe_delivered(users)

    def _observe_request(self, outcome: Outcome) -> None:
        """The per-request metrics: one statistic set each, per predicted shard for the
        per-Kinesis-record ones (see anykpl/_core/_metrics.py)."""
        observe = self.observe
        records: Sequence[KinesisRecord] = outcome.records
        start = outcome.start
        observe("RequestTime", None, None, StatisticSet.sample((outcome.end - start) * 1000))
        if not records:
            return
        observe("KinesisRecordsPerPutRecordsRequest", None, None, StatisticSet.sample(len(records)))
        users = 0
        by_shard: dict[str | None, _RequestShard] = {}
        for kr in records:
            n = kr.user_records
            users += n
            # BufferingTime, per Kinesis record: how long its oldest user record waited since
            # it arrived or its previous attempt ended (the KPL samples every user record)
            chunks = kr.chunks
            if chunks is not None:  # a column batch's items: never attempted before
                wait = (start - chunks[0][0].arrival) * 1000
            else:
                oldest = kr.records[0]
                last = oldest.last_attempt
                wait = (start - (oldest.arrival if last is None else last.end)) * 1000
            request = by_shard.get(kr.predicted_shard)
            if request is None:
                by_shard[kr.predicted_shard] = _RequestShard(n, wait)
                continue
            stats = request.user_records
            stats.count += 1
            stats.total += n
            if n < stats.minimum:
                stats.minimum = float(n)
            elif n > stats.maximum:
                stats.maximum = float(n)
            stats = request.buffering
            stats.count += 1
            stats.total += wait
            if wait < stats.minimum:
                stats.minimum = wait
            elif wait > stats.maximum:
                stats.maximum = wait
        observe("UserRecordsPerPutRecordsRequest", None, None, StatisticSet.sample(users))
        for shard, request in by_shard.items():
            observe("UserRecordsPerKinesisRecord", shard, None, request.user_records)
            observe("BufferingTime", shard, None, request.buffering)

    def _succeed_if_correct_shard(
        self,
        kr: KinesisRecord,
        actual: str,
        sequence_number: str,
        outcome: Outcome,
        now: float,
        users: dict[str, StatisticSet],
    ) -> None:
        predicted = kr.predicted_shard
        if predicted is not None and predicted != actual:
            readable = self._readable_in(kr, actual)
            if readable is None:
                self._hold(kr, actual, sequence_number, outcome)
                return
            if not readable:
                self._wrong_shard(kr, actual, outcome.start, outcome.end, now)
                return
            # landed in a child shard: the map is stale, help it converge
            if shard_number(predicted) < shard_number(actual) and self.shard_map.invalidate(
                outcome.start, predicted
            ):
                self.request_refresh()
        self._succeed(kr, actual, sequence_number, outcome.start, outcome.end, users)

    def _observe_delivered(self, users: dict[str, StatisticSet]) -> None:
        """The user records delivered, per actual shard: their count and their sizes."""
        observe = self.observe
        for shard, sizes in users.items():
            delivered_users = sizes.count
            observe(
                "UserRecordsPut", shard, None, StatisticSet(delivered_users, delivered_users, 1, 1)
            )
            observe("UserRecordsDataPut", shard, None, sizes)

    def _succeed(
        self,
        kr: KinesisRecord,
        actual: str,
        sequence_number: str,
        start: float,
        end: float,
        users: dict[str, StatisticSet],
    ) -> None:
        attempt = AttemptRecord(start, end, True, None, None)
        # the sizes of the user records delivered at the actual shard, for the response
        sizes = users.get(actual)
        if sizes is None:
            sizes = users[actual] = StatisticSet(0, 0, math.inf, 0)
        chunks = kr.chunks
        if chunks is not None:
            # a column batch's items: each chunk resolved with one count (ColumnBatch)
            total, low, high = kr.item_sizes
            sizes.count += kr.nitems
            sizes.total += total
            if low < sizes.minimum:
                sizes.minimum = float(low)
            if high > sizes.maximum:
                sizes.maximum = float(high)
            first = taken = taken_bytes = 0
            for columns, chunk in chunks:
                n, nbytes = columns.resolve_chunk(chunk, actual, sequence_number, first, attempt)
                taken += n
                taken_bytes += nbytes
                first += len(chunk)
            self._streaks.pop(kr.predicted_shard, None)
            if taken:
                # items taken over at close count out as records (Intake.finish), not here
                kr.nitems -= taken
                kr.item_bytes -= taken_bytes
            if kr.nitems:
                self.finish_items(kr)
            return
        records = kr.records
        if records:
            # the data sizes' count, total and extremes, measured by builtins (no bytecode
            # per record)
            data_sizes = list(map(len, map(_data_of, records)))
            sizes.count += len(data_sizes)
            sizes.total += sum(data_sizes)
            low = min(data_sizes)
            high = max(data_sizes)
            if low < sizes.minimum:
                sizes.minimum = float(low)
            if high > sizes.maximum:
                sizes.maximum = float(high)
        for index, record in enumerate(records):
            if record.last_attempt is None and record._state == PENDING:
                record.last_attempt = attempt  # Record.add_attempt's first attempt, inline
            else:
                record.add_attempt(attempt)
            record.shard_id = actual
            record.sequence_number = sequence_number
            record.sub_sequence_number = index
        self._streaks.pop(kr.predicted_shard, None)
        self.finish(kr.records, True)

    def _wrong_shard(
        self, kr: KinesisRecord, actual: str, start: float, end: float, now: float
    ) -> None:
        predicted = kr.predicted_shard
        logger.warning(
            "Kinesis record predicted for %s landed in %s; this usually means the "
            "shard map has changed",
            predicted,
            actual,
            extra={"stream": self.stream, "predicted": predicted, "actual": actual},
        )
        if self.shard_map.invalidate(start, predicted):
            self.request_refresh()
        attempt = AttemptRecord(
            start,
            end,
            False,
            errors.WRONG_SHARD,
            f"record did not end up in expected shard {predicted} (landed in {actual})",
        )
        self.count("ErrorsByCode", 1, predicted, errors.WRONG_SHARD)
        self._retry(kr.records, attempt, now, shard=predicted, backoff_key=None, backoff=False)

    def _readable_in(self, kr: KinesisRecord, actual: str) -> bool | None:
        """Whether every user record of ``kr``, stored in shard ``actual``, is where a reader
        expects it: in the shard whose hash range holds its hash key; ``None`` when that is not
        known yet. The service routes a Kinesis record by its explicit hash key, so a record
        whose user records all have that hash key (a raw record, or an aggregate of one key) is
        always where it belongs, known shard or not; an aggregate of several keys is, if its
        shard's range holds them all (the KCL drops the sub-records outside the range of the
        shard it reads), which the map knows once it has seen the shard.

        Where we differ: the KPL's retrier.cc retries every record whose shard differs from the
        prediction ("Wrong Shard"). A record that is already readable would then be stored a
        second time; anykpl accepts it."""
        hash_range = self.shard_map.hash_range(actual)
        if hash_range is not None:
            start, end = hash_range
            return all(start <= record.hash_key <= end for record in kr.records)
        routed = int(kr.explicit_hash_key)
        if all(record.hash_key == routed for record in kr.records):
            return True
        return None

    # -- outcomes from a shard the map has not seen ---------------------------------------

    def _hold(self, kr: KinesisRecord, actual: str, sequence_number: str, outcome: Outcome) -> None:
        """An aggregate of several keys stored in a shard the map does not know (a child of a
        split, under load): whether a reader keeps it depends on that shard's range. Retrying
        it at once would store needless duplicates of every sub-record that was in range, so it
        waits for a refresh of the map that started after it landed (:meth:`settle_held`)."""
        shard_map = self.shard_map
        # a refresh under way may have listed the shards before this one existed: the one
        # after it decides
        needed = shard_map.updates + (2 if shard_map.updating else 1)
        shard_map.invalidate(outcome.start, kr.predicted_shard)
        shard_map.want_refresh()
        self.request_refresh()
        self._held.append(_Held(kr, actual, sequence_number, outcome.start, outcome.end, needed))

    @property
    def held_records(self) -> int:
        """User records stored in a shard the map has not seen yet, waiting for its refresh."""
        return sum(held.kr.user_records for held in self._held)

    def settle_held(self, now: float, *, give_up_before: float = -math.inf) -> None:
        """Decide the held outcomes whose shard the map now knows: succeeded if its range holds
        every sub-record, retried as Wrong Shard if not. Once a refresh that started after an
        outcome has not shown its shard, it is retried (the KPL's behaviour for every such
        record); so is one that expires before ``give_up_before`` (a failed refresh passes the
        time of its next try: a map that cannot be had for ever does not keep a record from
        its expiry; ``math.inf`` gives up on every one)."""
        if not self._held:
            return
        updates = self.shard_map.updates
        users: dict[str, StatisticSet] = {}
        keep: list[_Held] = []
        for held in self._held:
            kr, actual = held.kr, held.actual
            readable = self._readable_in(kr, actual)
            if readable:
                self._succeed(kr, actual, held.sequence_number, held.start, held.end, users)
            elif readable is False or updates >= held.needed or kr.expiration < give_up_before:
                self._wrong_shard(kr, actual, held.start, held.end, now)
            else:
                keep.append(held)
        self._held = keep
        if self._failed:  # expired on the way to a retry
            self._log_failures()
        self._observe_delivered(users)

    def statistics(self) -> RetrierStatistics:
        """A frozen snapshot of the Retrier's counters."""
        budget = self.retry_budget
        return RetrierStatistics(
            throttled=dict(self.throttled),
            backoff_time=dict(self.backoff_time),
            delayed_records=self.delayed_records,
            retry_budget_exhausted=0 if budget is None else budget.exhausted,
        )

    def _fail_or_retry(self, kr: KinesisRecord, attempt: AttemptRecord, now: float) -> None:
        code = attempt.code or ""
        shard = kr.predicted_shard
        if code == errors.THROTTLED and shard is not None:
            throttles = self._throttles
            throttles[shard] = throttles.get(shard, 0) + 1
        if not errors.is_retriable(code) or (self.fail_if_throttled and code == errors.THROTTLED):
            self._fail(kr.records, attempt, shard)
        else:
            self._retry(kr.records, attempt, now, shard=shard, backoff_key=shard, backoff=True)

    def _fail(self, records: Sequence[Record], attempt: AttemptRecord, shard: str | None) -> None:
        """Fail user records for good (``shard``: their predicted shard, for the metrics)."""
        for record in records:
            record.add_attempt(attempt)
        failed = len(records)
        code = attempt.code or "UnknownError"
        earlier, _ = self._failed.get(code, (0, ""))
        self._failed[code] = (earlier + failed, attempt.message or "")
        if attempt.code == errors.EXPIRED:
            self.count("UserRecordExpired", failed, shard, None)
        self.count("UserRecordsFailed", failed, shard, attempt.code)
        # the KPL's 0 samples
        self.observe("UserRecordsPut", shard, None, StatisticSet(failed, 0, 0, 0))
        self.finish(records, False)

    def expire(self, records: Sequence[KinesisRecord], now: float) -> None:
        """Fail Kinesis records whose TTL passed while they waited in the limiter."""
        attempt = AttemptRecord(
            now, now, False, errors.EXPIRED, "Expiration reached while waiting in limiter"
        )
        for kr in records:
            self._fail(kr.records, attempt, kr.predicted_shard)
        self._log_failures()

    def expire_unsent(self, records: Sequence[Record], now: float, cause: str | None) -> None:
        """Fail user records whose TTL passed while they waited for the shard map (they were
        never sent); ``cause``: ListShards' last error, if it failed."""
        message = "Expiration reached while waiting for the shard map"
        if cause is not None:
            message = f"{message} (ListShards failed: {cause})"
        attempt = AttemptRecord(now, now, False, errors.EXPIRED, message)
        self._fail(records, attempt, None)
        self._log_failures()

    def _retry(
        self,
        records: Sequence[Record],
        attempt: AttemptRecord,
        now: float,
        *,
        shard: str | None,
        backoff_key: str | None,
        backoff: bool,
    ) -> None:
        expired_attempt: AttemptRecord | None = None
        retry: list[Record] = []
        expired: list[Record] = []
        for record in records:
            record.add_attempt(attempt)
            if record.expiration < now:
                expired.append(record)
            else:
                retry.append(record)
        if expired:
            expired_attempt = AttemptRecord(
                now, now, False, errors.EXPIRED, "Record has reached expiration"
            )
            self._fail(expired, expired_attempt, shard)
        if not retry:
            return
        self.count("RetriesPerRecord", len(retry), shard, None)
        delay = 0.0
        if backoff:
            streak = self._streaks.get(backoff_key, 0)
            if backoff_key in self._advanced:
                streak -= 1  # the step this outcome already took
            else:
                self._advanced.add(backoff_key)
                self._streaks[backoff_key] = streak + 1
            # the doubling stops at the maximum: a long outage makes streaks of thousands
            # (and 2.0 ** 1024 overflows)
            cap = min(self.backoff_max, self.backoff_initial * (2.0 ** min(streak, 64)))
            budget = self.retry_budget
            spent = self._budget_spent
            if budget is not None and backoff_key not in spent:
                # one retry for the budget per shard per outcome, however many of the
                # shard's Kinesis records it retries: like the backoff step above
                spent[backoff_key] = budget.try_spend(now)
            if budget is not None and not spent[backoff_key]:
                # the budget is spent: wait the longest backoff (jittered) instead
                delay = self.rng.uniform(self.backoff_max / 2, self.backoff_max)
            else:
                delay = self.rng.uniform(0.0, cap)
            if delay:
                times = self.backoff_time
                times[shard] = times.get(shard, 0.0) + delay * len(retry)
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

    def take_due(self, now: float) -> list[Record]:
        """The retried records whose backoff has passed."""
        due: list[Record] = []
        while self._delayed and self._delayed[0][0] <= now:
            due.extend(heapq.heappop(self._delayed)[2])
        self.delayed_records -= len(due)
        return due

    def take_all(self) -> list[Record]:
        records = [r for item in self._delayed for r in item[2]]
        for held in self._held:
            # stored, in a shard whose range was never learned: the records keep that attempt
            attempt = AttemptRecord(
                held.start,
                held.end,
                False,
                errors.WRONG_SHARD,
                f"stored in {held.actual}, a shard the map had not listed yet; not known "
                "whether a reader keeps it",
            )
            for record in held.kr.records:
                record.add_attempt(attempt)
                records.append(record)
        self._held.clear()
        self._delayed.clear()
        self.delayed_records = 0
        return records


def _sums_only(count: Count) -> Observe:
    """An ``observe`` that passes each statistic set's sum to ``count`` (when a caller only
    counts events, as the Retrier's tests do)."""

    def observe(name: str, shard: str | None, code: str | None, stats: StatisticSet) -> None:
        if stats.total:
            count(name, int(stats.total), shard, code)

    return observe


def _no_column_items(kr: KinesisRecord) -> None:
    """A Retrier's ``finish_items`` where it was given none: no column batch reaches it (a
    stream intake without the producer's ``finish_items`` admits none)."""
    raise RuntimeError(f"{kr!r} carries column items, and this Retrier cannot count them out")
