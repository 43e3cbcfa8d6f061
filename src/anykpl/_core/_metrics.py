"""The KPL's metrics, kept in process as statistic sets (aws/metrics/*).

Mirrors ``aws/metrics/metrics_manager.{h,cc}``, ``accumulator.h`` and ``metrics_constants.cc``:

- every metric has a name, a unit and a level (``summary`` or ``detailed``), and is recorded
  with up to three dimensions — ``ErrorCode``, ``StreamName``, ``ShardId`` — in that order;
- a data point counts at its own level and at every level above it (``Metric::put`` feeds its
  ancestors), so one shard-level point is visible per shard, per stream and globally;
- values accumulate into statistic sets (count, sum, min, max) in one-second buckets, 60 of
  which are kept for local queries (:meth:`Metrics.query`, the KPL's ``getMetrics``);
- an upload takes what accumulated since the last one, filtered by ``metrics_level`` and
  ``metrics_granularity`` (``constants::filter``);
- the KPL's 0-valued samples are kept: a user record that fails for good is a 0 sample of
  ``UserRecordsPut``, a failed Kinesis record a 0 of ``KinesisRecordsPut``, a delivered one a
  0 of ``AllErrors`` — so ``Sum / SampleCount`` is a success (or error) rate, as in the KPL.

Where we differ, and why (every difference we know of):

- **Counting per batch.** The KPL puts one data point per user record; we merge what one
  PutRecords outcome adds up to per shard — count, sum, min and max — in one call per metric,
  because the hot path is measured. The statistic sets are the KPL's; only the number of calls
  differs. ``UserRecordsReceived`` is not counted per ``put``: the pipelines' admission
  counters are folded in when a one-second bucket closes (and when the metrics are read). A
  bucket closes at the first sample after its second, which comes within about
  ``record_max_buffered_time`` of a ``put``, so a received record can be dated up to that much
  late or early, never more unless the stream stops sending.
- **``BufferingTime``** has one sample per Kinesis record per attempt (its oldest user
  record's wait), not one per user record, so its ``SampleCount`` counts Kinesis records; it
  is per predicted shard, as in the KPL.
- **``RetriesPerRecord``** is one sample of 1 per user record sent back for a retry, at the
  predicted shard, when the retry is decided; the KPL samples ``attempts - 1`` once per user
  record when it finishes (so there ``Maximum`` is the most retries of one record; here
  ``Sum`` is the same and ``Maximum`` is 1). Recording it at the finish would cost a look at
  every user record's attempts on the hot path.
- **Failures at close.** Records failed when the producer closes or a stage crashes
  (``ProducerClosed``, ``PipelineFailed``) count as 0 samples of ``UserRecordsPut`` and in
  ``UserRecordsFailed`` at the stream level: no shard is known for them.
- ``ErrorsByCode`` and ``AllErrors`` of a failed request (no response) are at the stream level,
  as in the KPL; the per-record ones at the predicted shard.
- ``UserRecordsPending`` (user records admitted and not yet terminal, per stream) is sampled
  once a second, as the first bucket after each second closes; the KPL samples it every
  200 ms, so its ``SampleCount`` is a fifth, and a peak shorter than a second can be missed.
- **Uploads are exact intervals.** The KPL uploads ``[last checkpoint, now - 1 s]`` from its
  buckets; we close the current bucket at each upload, so every sample is uploaded exactly once
  and nothing waits a second longer.
- ``UserRecordsFailed`` (user records that ended in failure, by ``ErrorCode``, at the
  predicted shard) is ours.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, Literal

__all__ = (
    "HISTORY_SECONDS",
    "METRICS",
    "MetricKey",
    "MetricValue",
    "Metrics",
    "MetricsLevel",
    "Unit",
    "leaves",
    "with_ancestors",
)

Unit = Literal["Count", "Bytes", "Milliseconds"]
MetricsLevel = Literal["summary", "detailed"]

#: name -> (unit, level): the KPL's table (metrics_constants.cc; kpl.md §5).
METRICS: Final[Mapping[str, tuple[Unit, MetricsLevel]]] = {
    "UserRecordsReceived": ("Count", "detailed"),
    "UserRecordsPending": ("Count", "detailed"),
    "UserRecordsPut": ("Count", "summary"),
    "UserRecordsDataPut": ("Bytes", "detailed"),
    "KinesisRecordsPut": ("Count", "summary"),
    "KinesisRecordsDataPut": ("Bytes", "detailed"),
    "ErrorsByCode": ("Count", "summary"),
    "AllErrors": ("Count", "summary"),
    "RetriesPerRecord": ("Count", "detailed"),
    "UserRecordExpired": ("Count", "summary"),
    "BufferingTime": ("Milliseconds", "summary"),
    "RequestTime": ("Milliseconds", "detailed"),
    "UserRecordsPerKinesisRecord": ("Count", "detailed"),
    "KinesisRecordsPerPutRecordsRequest": ("Count", "detailed"),
    "UserRecordsPerPutRecordsRequest": ("Count", "detailed"),
    "UserRecordsFailed": ("Count", "detailed"),  # ours
    "UserRecordsRecovered": ("Count", "summary"),  # ours: read back from the spool
    "SpoolCorruptEntries": ("Count", "summary"),  # ours: skipped by the spool's recovery
}

#: One-second buckets kept for :meth:`Metrics.query` (the KPL keeps 60).
HISTORY_SECONDS: Final = 60

_GRANULARITY_DEPTH: Final = {"global": 0, "stream": 1, "shard": 2}

#: (name, stream, shard, error code)
_Key = tuple[str, "str | None", "str | None", "str | None"]
#: [count, sum, min, max]
_Stats = list[float]


@dataclass(frozen=True, slots=True, order=True)
class MetricKey:
    """A metric's name and dimensions (``None`` where a dimension does not apply)."""

    name: str
    stream: str | None = None
    shard: str | None = None
    error_code: str | None = None


@dataclass(frozen=True, slots=True)
class MetricValue:
    """One metric at one set of dimensions, as a statistic set over a span of time.

    Attributes:
        name: the KPL metric name, such as ``"UserRecordsPut"``.
        unit: ``"Count"``, ``"Bytes"`` or ``"Milliseconds"``.
        level: ``"summary"`` or ``"detailed"``.
        stream: the ``StreamName`` dimension, or ``None`` at the global level.
        shard: the ``ShardId`` dimension, or ``None`` above the shard level.
        error_code: the ``ErrorCode`` dimension (``ErrorsByCode``, ``UserRecordsFailed``).
        count: number of samples (CloudWatch's ``SampleCount``).
        sum: sum of the samples.
        min: smallest sample.
        max: largest sample.
        duration: seconds the statistics cover.
    """

    name: str
    unit: Unit
    level: MetricsLevel
    stream: str | None
    shard: str | None
    error_code: str | None
    count: float
    sum: float
    min: float
    max: float
    duration: float

    @property
    def mean(self) -> float:
        """``sum / count`` (0 without samples)."""
        return self.sum / self.count if self.count else 0.0

    @property
    def granularity(self) -> Literal["global", "stream", "shard"]:
        if self.shard is not None:
            return "shard"
        return "stream" if self.stream is not None else "global"

    @property
    def dimensions(self) -> tuple[tuple[str, str], ...]:
        """The dimensions in the KPL's order: ``ErrorCode``, ``StreamName``, ``ShardId``."""
        out: list[tuple[str, str]] = []
        if self.error_code is not None:
            out.append(("ErrorCode", self.error_code))
        if self.stream is not None:
            out.append(("StreamName", self.stream))
        if self.shard is not None:
            out.append(("ShardId", self.shard))
        return tuple(out)


def _merge_into(target: dict[_Key, _Stats], source: Mapping[_Key, _Stats]) -> None:
    for key, stats in source.items():
        mine = target.get(key)
        if mine is None:
            target[key] = list(stats)
        else:
            mine[0] += stats[0]
            mine[1] += stats[1]
            if stats[2] < mine[2]:
                mine[2] = stats[2]
            if stats[3] > mine[3]:
                mine[3] = stats[3]


def with_ancestors(stats: Mapping[_Key, _Stats]) -> dict[_Key, _Stats]:
    """Each data point at its own level and at the stream and global levels above it."""
    out: dict[_Key, _Stats] = {}
    for (name, stream, shard, code), value in stats.items():
        keys = {(name, None, None, code), (name, stream, None, code), (name, stream, shard, code)}
        _merge_into(out, dict.fromkeys(keys, value))
    return out


def leaves(stats: Mapping[_Key, _Stats], granularity: str) -> dict[_Key, _Stats]:
    """Each data point once, cut to ``granularity`` (deeper dimensions merged away)."""
    depth = _GRANULARITY_DEPTH[granularity]
    out: dict[_Key, _Stats] = {}
    for (name, stream, shard, code), value in stats.items():
        key = (name, stream if depth >= 1 else None, shard if depth >= 2 else None, code)
        _merge_into(out, {key: value})
    return out


def to_values(
    stats: Mapping[_Key, _Stats],
    duration: float,
    *,
    name: str | None = None,
    level: str = "detailed",
    granularity: str = "shard",
) -> tuple[MetricValue, ...]:
    """Statistic sets as :class:`MetricValue` s, sorted, filtered like the KPL's upload
    (``constants::filter``: level ≤ ``level`` and granularity ≤ ``granularity``)."""
    depth = _GRANULARITY_DEPTH[granularity]
    out = []
    for key in sorted(stats, key=_sort_key):
        metric, stream, shard, code = key
        if name is not None and metric != name:
            continue
        unit, metric_level = METRICS.get(metric, ("Count", "detailed"))
        if level == "none" or (level == "summary" and metric_level != "summary"):
            continue
        if (shard is not None and depth < 2) or (stream is not None and depth < 1):
            continue
        count, total, low, high = stats[key]
        if count <= 0:
            continue
        out.append(
            MetricValue(
                metric, unit, metric_level, stream, shard, code, count, total, low, high, duration
            )
        )
    return tuple(out)


def _sort_key(key: _Key) -> tuple[str, str, str, str]:
    name, stream, shard, code = key
    return (name, code or "", stream or "", shard or "")


class Metrics:
    """Statistic sets keyed by (name, stream, shard, error code), in one-second buckets.

    Pure and clock-injected: ``clock`` is read once per recorded batch. The producer sets it to
    the running backend's clock when it opens.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        #: called when a bucket closes and before the metrics are read, to fold counters kept
        #: elsewhere into the current bucket (with :meth:`add_to_bucket`)
        self.collect: Callable[[], None] | None = None
        #: called when a bucket closes, to sample gauges into it (with
        #: :meth:`sample_to_bucket`): once per second, not at every read
        self.gauge: Callable[[], None] | None = None
        self._gauge_due = math.inf  # the gauges are sampled at the first roll from then on
        self._bucket: dict[_Key, _Stats] = {}
        self._bucket_start = -math.inf
        self._bucket_end = -math.inf
        self._history: deque[tuple[float, dict[_Key, _Stats]]] = deque()
        self._total: dict[_Key, _Stats] = {}
        self._started: float | None = None
        #: statistics not yet handed to sinks; ``None`` while nothing uploads
        self._unsent: dict[_Key, _Stats] | None = None
        self._unsent_since = 0.0

    # -- recording (once per batch) -------------------------------------------------------

    def add(
        self, name: str, value: float, stream: str | None, shard: str | None, code: str | None
    ) -> None:
        """``value`` events, each a sample of 1 (a count metric)."""
        if value:
            self.observe(name, stream, shard, code, value, value, 1.0, 1.0)

    def sample(
        self, name: str, value: float, stream: str | None, shard: str | None, code: str | None
    ) -> None:
        """One sample of ``value`` (a time, a size)."""
        self.observe(name, stream, shard, code, 1, value, value, value)

    def observe(
        self,
        name: str,
        stream: str | None,
        shard: str | None,
        code: str | None,
        count: float,
        total: float,
        low: float,
        high: float,
    ) -> None:
        """Merge a statistic set (``count`` samples summing to ``total``, between ``low`` and
        ``high``)."""
        now = self.clock()
        if now >= self._bucket_end:
            self._roll(now)
        self._merge((name, stream, shard, code), count, total, low, high)

    def _merge(self, key: _Key, count: float, total: float, low: float, high: float) -> None:
        """Merge a statistic set into the current bucket."""
        stats = self._bucket.get(key)
        if stats is None:
            self._bucket[key] = [count, total, low, high]
        else:
            stats[0] += count
            stats[1] += total
            if low < stats[2]:
                stats[2] = low
            if high > stats[3]:
                stats[3] = high

    def add_to_bucket(
        self, name: str, value: float, stream: str | None, shard: str | None, code: str | None
    ) -> None:
        """Like :meth:`add`, into the current bucket without reading the clock (for
        :attr:`collect`)."""
        if not value:
            return
        key = (name, stream, shard, code)
        stats = self._bucket.get(key)
        if stats is None:
            self._bucket[key] = [value, value, 1.0, 1.0]
        else:
            stats[0] += value
            stats[1] += value

    def start(self) -> None:
        """Open the first one-second bucket now (the producer opens), if nothing has yet:
        from then on every second that ends has its gauges sampled as its bucket closes."""
        if self._started is None:
            self._roll(self.clock())

    def sample_to_bucket(self, name: str, value: float, stream: str | None) -> None:
        """Like :meth:`sample`, into the current bucket without reading the clock (for
        :attr:`gauge`)."""
        self._merge((name, stream, None, None), 1.0, value, value, value)

    def _roll(self, now: float) -> None:
        """Close the current bucket and start the one ``now`` falls in."""
        if self._started is None:
            self._started = now
            self._unsent_since = now
            self._gauge_due = math.floor(now) + 1.0
        else:
            if self.collect is not None:
                self.collect()  # what was counted elsewhere during the bucket's second
            if self.gauge is not None and now >= self._gauge_due:
                # the gauges, as a second ends: once a second, also when uploads close
                # buckets more often (take_unsent)
                self.gauge()
                self._gauge_due = math.floor(now) + 1.0
        bucket = self._bucket
        if bucket:
            _merge_into(self._total, bucket)
            if self._unsent is not None:
                _merge_into(self._unsent, bucket)
            self._history.append((self._bucket_start, bucket))
            self._bucket = {}
        horizon = now - HISTORY_SECONDS
        history = self._history
        while history and history[0][0] < horizon:
            history.popleft()
        self._bucket_start = now
        self._bucket_end = math.floor(now) + 1.0

    # -- reading --------------------------------------------------------------------------

    def _refresh(self) -> float:
        """Before a read: close the current bucket if its second is over, and fold in the
        counters kept elsewhere. Returns the time."""
        now = self.clock()
        if now >= self._bucket_end:
            self._roll(now)
        if self.collect is not None:
            self.collect()
        return now

    def enable_uploads(self) -> None:
        """Start keeping the statistics not yet taken by :meth:`take_unsent`."""
        if self._unsent is None:
            self._unsent = {}
            self._unsent_since = self.clock()

    def take_unsent(self) -> tuple[dict[_Key, _Stats], float, float]:
        """(statistics since the last call, its start, its end): closes the current bucket."""
        now = self.clock()
        self._roll(now)
        self._bucket_end = -math.inf  # the next sample starts a fresh bucket
        taken = self._unsent or {}
        start = self._unsent_since
        self._unsent = {}
        self._unsent_since = now
        return taken, start, now

    def cumulative(self) -> dict[_Key, _Stats]:
        """Every statistic since the first sample (data points at their own level)."""
        self._refresh()
        out = {key: list(stats) for key, stats in self._total.items()}
        _merge_into(out, self._bucket)
        return out

    def window(self, seconds: float) -> dict[_Key, _Stats]:
        """The statistics of the last ``seconds`` (at one-second resolution, up to 60)."""
        horizon = self._refresh() - seconds
        out: dict[_Key, _Stats] = {}
        for start, bucket in self._history:
            if start + 1.0 > horizon:
                _merge_into(out, bucket)
        _merge_into(out, self._bucket)
        return out

    def query(self, name: str | None = None, window: float | None = None) -> list[MetricValue]:
        """The KPL's ``getMetrics``: every metric at every level, cumulative or over the last
        ``window`` seconds."""
        now = self._refresh()
        if window is None:
            stats = self.cumulative()
            duration = now - self._started if self._started is not None else 0.0
        else:
            stats = self.window(window)
            duration = window
        return list(to_values(with_ancestors(stats), duration, name=name))

    def snapshot(self) -> Mapping[MetricKey, float]:
        """Every metric's sum, at its own level and summed into the stream and global levels."""
        return {
            MetricKey(*key): stats[1] for key, stats in with_ancestors(self.cumulative()).items()
        }

    def by_error_code(self) -> dict[str, int]:
        self._refresh()
        out: dict[str, int] = {}
        for items in (self._total.items(), self._bucket.items()):
            for (name, _, _, code), stats in items:
                if name == "ErrorsByCode" and code is not None:
                    out[code] = out.get(code, 0) + int(stats[1])
        return out
