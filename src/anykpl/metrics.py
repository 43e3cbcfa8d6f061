"""Metrics out of the process: the :class:`MetricsSink` protocol and the sinks that ship.

A producer given sinks (``Producer(..., metrics_sinks=[...])``) runs one upload task in its
task group. Every ``metrics_upload_delay`` seconds the task takes the statistics accumulated
since the previous upload (count, sum, min and max per metric and dimensions), filters them by
``metrics_level`` and ``metrics_granularity`` as the KPL does, and hands one
:class:`MetricsReport` to each sink — to all at once, each ``publish`` bounded by
:data:`PUBLISH_TIMEOUT` and ``metrics_upload_delay``. A sink that fails or hangs is logged on
the ``anykpl.metrics`` logger and counted; it never holds up the other sinks or reaches the
pipeline. A last report goes out when the producer closes, also when its block is left by
cancellation; closing, the last report and closing the sinks included, takes at most
``close_timeout`` + :data:`CLOSE_GRACE`. Without sinks no task runs and nothing extra is done.

Sinks:

- :class:`CloudWatchSink`: ``PutMetricData`` with statistic sets, as the KPL uploads them.
- :class:`PrometheusSink`: counters, gauges and histograms in a ``prometheus_client`` registry
  (extra ``anykpl[prometheus]``).
- :class:`OpenTelemetrySink`: counters and histograms through the OpenTelemetry metrics API
  (extra ``anykpl[otel]``).

The heavy dependencies are imported when a sink is created, never by ``import anykpl``.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager, suppress
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Final, Protocol, runtime_checkable
from urllib.parse import quote_plus

import anyio

from ._metrics import METRICS, Metrics, MetricValue, leaves, to_values, with_ancestors

if TYPE_CHECKING:
    from .config import ProducerConfig

__all__ = (
    "CLOSE_GRACE",
    "FINAL_REPORT_WHEN_CANCELLED",
    "PUBLISH_TIMEOUT",
    "CloudWatchSink",
    "MetricValue",
    "MetricsReport",
    "MetricsSink",
    "OpenTelemetrySink",
    "PrometheusSink",
)

logger = logging.getLogger("anykpl.metrics")

#: Metrics that count events (their sum is what matters): counters in Prometheus and
#: OpenTelemetry. The rest are distributions (histograms).
_COUNTERS: Final = frozenset(
    {
        "UserRecordsReceived",
        "UserRecordsPut",
        "UserRecordsDataPut",
        "KinesisRecordsPut",
        "KinesisRecordsDataPut",
        "ErrorsByCode",
        "AllErrors",
        "RetriesPerRecord",
        "UserRecordExpired",
        "UserRecordsFailed",
    }
)


@dataclass(frozen=True, slots=True)
class MetricsReport:
    """What a sink receives at each upload.

    Attributes:
        timestamp: wall-clock time (UTC) at the end of the interval.
        duration: seconds the interval covers.
        values: the KPL's view, for CloudWatch: every metric at every level down to
            ``metrics_granularity`` (a shard-level point also counts in its stream and global
            aggregates), filtered by ``metrics_level``; sorted by name and dimensions.
        leaves: each sample once, at the deepest level ``metrics_granularity`` allows, for
            systems that aggregate labels themselves (Prometheus, OpenTelemetry).
        final: ``True`` for the last report, sent when the producer closes.
    """

    timestamp: datetime
    duration: float
    values: tuple[MetricValue, ...]
    leaves: tuple[MetricValue, ...]
    final: bool = False


@runtime_checkable
class MetricsSink(Protocol):
    """Where the producer's metrics go. Two methods:

    - ``open(config)`` returns an async context manager, entered in the producer's upload task
      when the producer opens and exited when it closes (open and close clients there);
    - ``publish(report)`` receives each :class:`MetricsReport`. It may raise: the error is
      logged and counted, and the next report comes as usual. It is cancelled if it takes
      longer than ``min(metrics_upload_delay, PUBLISH_TIMEOUT)`` (or than the close allows).
    """

    def open(self, config: ProducerConfig) -> AbstractAsyncContextManager[object]: ...

    async def publish(self, report: MetricsReport) -> None: ...


@asynccontextmanager
async def _nothing_to_open() -> AsyncIterator[None]:
    yield


def snake_case(name: str) -> str:
    """``UserRecordsPerPutRecordsRequest`` → ``user_records_per_put_records_request``."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


# --- the upload task ------------------------------------------------------------------------

#: The longest one sink's ``publish`` (or ``open``) may take; it is also bounded by
#: ``metrics_upload_delay``, so a slow sink never holds up the next report.
PUBLISH_TIMEOUT: Final = 30.0
#: What closing may add to ``close_timeout``: when the flush used all of it, the last report
#: still gets FINAL_REPORT_MIN seconds and closing the sinks SINK_CLOSE_MIN.
FINAL_REPORT_MIN: Final = 0.25
SINK_CLOSE_MIN: Final = 0.25
CLOSE_GRACE: Final = FINAL_REPORT_MIN + SINK_CLOSE_MIN
#: The bound of the last report when the producer's block is left by cancellation (or
#: ``close_timeout`` if smaller).
FINAL_REPORT_WHEN_CANCELLED: Final = 2.0


class Uploader:
    """The producer's upload task: one per producer, only when sinks are configured.

    Each report goes to every sink at once, each ``publish`` in its own task and bounded by
    :data:`PUBLISH_TIMEOUT` and ``metrics_upload_delay``: a sink that hangs or fails is logged
    and counted, and the others get their reports all the same. The task is shielded from
    cancellation around the producer, so that the last report goes out even then; the
    producer ends it with :meth:`close` (one deadline for the last report and closing the
    sinks) and :meth:`abort`.
    """

    def __init__(
        self, metrics: Metrics, sinks: Sequence[MetricsSink], config: ProducerConfig
    ) -> None:
        self.metrics = metrics
        self.sinks = tuple(sinks)
        self.config = config
        self.publish_timeout = min(config.metrics_upload_delay, PUBLISH_TIMEOUT)
        self.uploads = 0
        #: failed or timed-out ``publish`` (or ``open``) calls, per sink index
        self.failures = [0] * len(self.sinks)
        self._stop = anyio.Event()
        self._done = anyio.Event()
        self._close_deadline = -math.inf  # set by close(); closing without it is brief
        self._scope = anyio.CancelScope(shield=True)
        #: scopes of the open/publish calls running now: close() brings their deadlines in
        self._bounded_scopes: set[anyio.CancelScope] = set()
        metrics.enable_uploads()

    async def run(self) -> None:
        with self._scope:
            try:
                async with AsyncExitStack() as stack:
                    try:
                        await self._run(stack)
                    finally:
                        # close the sinks' clients even when cancelled, within the deadline
                        now = anyio.current_time()
                        bound = max(self._close_deadline, now + SINK_CLOSE_MIN)
                        bound = min(bound, now + self.publish_timeout)
                        with anyio.CancelScope(deadline=bound, shield=True):
                            await stack.aclose()
            finally:
                self._done.set()

    async def _run(self, stack: AsyncExitStack) -> None:
        opened: list[tuple[int, MetricsSink]] = []
        for index, sink in enumerate(self.sinks):
            deadline = anyio.current_time() + self.publish_timeout
            context = sink.open(self.config)
            if await self._bounded(index, "open", stack.enter_async_context, context, deadline):
                opened.append((index, sink))
        delay = self.config.metrics_upload_delay
        next_upload = anyio.current_time() + delay
        while True:
            with anyio.CancelScope(deadline=next_upload):
                await self._stop.wait()
            if self._stop.is_set():
                break
            now = anyio.current_time()
            next_upload = now + delay
            await self._publish(opened, final=False, deadline=now + self.publish_timeout)
        now = anyio.current_time()
        deadline = max(self._close_deadline, now + FINAL_REPORT_MIN)
        await self._publish(opened, final=True, deadline=min(deadline, now + self.publish_timeout))

    async def close(self, deadline: float) -> None:
        """Send the final report and close the sinks, by ``deadline`` (plus at most
        :data:`CLOSE_GRACE`). Shielded: it runs even in a cancelled scope."""
        self._close_deadline = deadline
        for scope in self._bounded_scopes:
            scope.deadline = min(scope.deadline, deadline)
        self._stop.set()
        with anyio.CancelScope(deadline=deadline + CLOSE_GRACE, shield=True):
            await self._done.wait()

    def abort(self) -> None:
        """End the task now (after :meth:`close`, or if it was never called)."""
        self._scope.cancel()

    def report(self, *, final: bool) -> MetricsReport:
        stats, start, end = self.metrics.take_unsent()
        config = self.config
        level, granularity = config.metrics_level, config.metrics_granularity
        duration = end - start
        return MetricsReport(
            timestamp=datetime.now(timezone.utc),
            duration=duration,
            values=to_values(with_ancestors(stats), duration, level=level, granularity=granularity),
            leaves=to_values(
                leaves(stats, granularity), duration, level=level, granularity=granularity
            ),
            final=final,
        )

    async def _publish(
        self, sinks: Sequence[tuple[int, MetricsSink]], *, final: bool, deadline: float
    ) -> None:
        report = self.report(final=final)
        self.uploads += 1
        async with anyio.create_task_group() as tg:
            for index, sink in sinks:
                tg.start_soon(self._bounded, index, "publish", sink.publish, report, deadline)

    async def _bounded(
        self,
        index: int,
        what: str,
        call: Callable[[Any], Awaitable[object]],
        arg: Any,
        deadline: float,
    ) -> bool:
        """``await call(arg)`` by ``deadline`` (brought in by :meth:`close`); ``False`` if it
        raised or ran out of time (logged, and counted in :attr:`failures`)."""
        sink = self.sinks[index]
        with anyio.CancelScope(deadline=deadline) as scope:
            self._bounded_scopes.add(scope)
            try:
                await call(arg)
            except Exception:
                self.failures[index] += 1
                logger.exception("metrics sink %r failed to %s", sink, what)
                return False
            finally:
                self._bounded_scopes.discard(scope)
            return True
        self.failures[index] += 1
        logger.warning(
            "metrics sink %r did not %s in time (report dropped for this sink)", sink, what
        )
        return False


# --- CloudWatch -----------------------------------------------------------------------------

#: The KPL's limits per PutMetricData call (metrics_manager.cc): at most 20 metric data and
#: about 38 KiB of payload. CloudWatch now accepts 1000 data and 1 MB, but these work with every
#: endpoint (older regions, emulators) and keep each call small.
CLOUDWATCH_MAX_DATUMS: Final = 20
CLOUDWATCH_MAX_PAYLOAD: Final = 38 * 1024


#: A query-encoded timestamp, the longest form: ``2026-11-21T10%3A00%3A00.123456Z``.
_TIMESTAMP_SIZE: Final = 32


def _pair_size(key: str, value: object) -> int:
    """``&key=value``, form-encoded."""
    return 2 + len(key) + len(quote_plus(str(value)))


def _request_size(namespace: str) -> int:
    """``Action=PutMetricData&Version=2010-08-01&Namespace=...``."""
    return (
        _pair_size("Action", "PutMetricData")
        + _pair_size("Version", "2010-08-01")
        + _pair_size("Namespace", namespace)
        - 1
    )


def _estimated_size(datum: Mapping[str, Any], index: int = 1000) -> int:
    """A datum's size in the query protocol's form encoding (the largest of CloudWatch's
    encodings; botocore now sends CBOR, about 30 % smaller), as the ``index``-th datum of a
    request. Exact but for the timestamp, counted at its longest."""
    prefix = f"MetricData.member.{index}."
    size = _pair_size(prefix + "MetricName", datum["MetricName"])
    if "Dimensions" in datum and not datum["Dimensions"]:
        size += _pair_size(prefix + "Dimensions", "")  # an empty list is still sent
    for number, dimension in enumerate(datum.get("Dimensions", ()), 1):
        stem = f"{prefix}Dimensions.member.{number}."
        size += _pair_size(stem + "Name", dimension["Name"])
        size += _pair_size(stem + "Value", dimension["Value"])
    if "Timestamp" in datum:
        size += 2 + len(prefix) + len("Timestamp") + _TIMESTAMP_SIZE
    for name, value in datum.get("StatisticValues", {}).items():
        size += _pair_size(f"{prefix}StatisticValues.{name}", value)
    if "Value" in datum:
        size += _pair_size(prefix + "Value", datum["Value"])
    if "Unit" in datum:
        size += _pair_size(prefix + "Unit", datum["Unit"])
    return size


def cloudwatch_batches(
    data: Sequence[Mapping[str, Any]],
    max_datums: int = CLOUDWATCH_MAX_DATUMS,
    max_payload: int = CLOUDWATCH_MAX_PAYLOAD,
    namespace: str = "KinesisProducerLibrary",
) -> list[list[Mapping[str, Any]]]:
    """Split metric data into PutMetricData calls of ≤ ``max_datums`` data and ≤
    ``max_payload`` bytes of query-encoded body (``namespace`` included)."""
    batches: list[list[Mapping[str, Any]]] = []
    batch: list[Mapping[str, Any]] = []
    empty = size = _request_size(namespace)
    for datum in data:
        datum_size = _estimated_size(datum, len(batch) + 1)
        if batch and (len(batch) >= max_datums or size + datum_size > max_payload):
            batches.append(batch)
            batch, size = [], empty
            datum_size = _estimated_size(datum, 1)
        batch.append(datum)
        size += datum_size
    if batch:
        batches.append(batch)
    return batches


def cloudwatch_datum(value: MetricValue, timestamp: datetime) -> dict[str, Any]:
    """One ``MetricDatum`` with a ``StatisticValues`` statistic set."""
    return {
        "MetricName": value.name,
        "Dimensions": [{"Name": name, "Value": v} for name, v in value.dimensions],
        "Timestamp": timestamp,
        "StatisticValues": {
            "SampleCount": float(value.count),
            "Sum": float(value.sum),
            "Minimum": float(value.min),
            "Maximum": float(value.max),
        },
        "Unit": value.unit,
    }


class CloudWatchSink:
    """Uploads the metrics to CloudWatch like the KPL: ``PutMetricData`` with statistic sets
    (``SampleCount``, ``Sum``, ``Minimum``, ``Maximum``), at most 20 data and about 38 KiB per
    call, in ``namespace`` (default: the config's ``metrics_namespace``).

    The aiobotocore client takes the producer's region, profile, credentials, TLS verification,
    timeouts and HTTP backend. ``endpoint_url`` is CloudWatch's own endpoint (the KPL's
    ``CloudwatchEndpoint``/``CloudwatchPort``); default ``None``: botocore's chain
    (``AWS_ENDPOINT_URL_CLOUDWATCH``, then the region's endpoint) — never the Kinesis
    ``endpoint_url``. Failed calls are logged on ``anykpl.metrics`` and counted in
    :attr:`failures`; the data of a failed call is dropped, as the KPL drops it.

    After a connection-level failure (the endpoint unreachable, a timeout) the rest of that
    upload is dropped with one log line rather than tried call after call.

    Attributes:
        calls: successful PutMetricData calls.
        failures: failed PutMetricData calls.
        data_sent: metric data uploaded.
        data_dropped: metric data dropped (failed calls and the rest of their upload).
    """

    def __init__(
        self,
        *,
        namespace: str | None = None,
        endpoint_url: str | None = None,
        region: str | None = None,
        max_datums: int = CLOUDWATCH_MAX_DATUMS,
        max_payload: int = CLOUDWATCH_MAX_PAYLOAD,
    ) -> None:
        if not 1 <= max_datums <= 1000:
            raise ValueError(f"max_datums must be in 1..1000, got {max_datums}")
        if namespace is not None and (not 1 <= len(namespace) <= 255 or namespace[:4] == "AWS/"):
            raise ValueError(f"invalid CloudWatch namespace {namespace!r}")
        self.namespace = namespace
        self.endpoint_url = endpoint_url
        self.region = region
        self.max_datums = max_datums
        self.max_payload = max_payload
        self.calls = 0
        self.failures = 0
        self.data_sent = 0
        self.data_dropped = 0
        self._client: Any = None
        self._namespace = namespace or "KinesisProducerLibrary"

    def __repr__(self) -> str:
        return f"<CloudWatchSink namespace={self._namespace!r} endpoint={self.endpoint_url!r}>"

    @asynccontextmanager
    async def open(self, config: ProducerConfig) -> AsyncIterator[None]:
        from ._aws import create_client

        self._namespace = self.namespace or config.metrics_namespace
        async with create_client(
            config,
            "cloudwatch",
            max_pool_connections=2,
            region=self.region,
            endpoint_url=self.endpoint_url,
        ) as client:
            self._client = client
            try:
                yield
            finally:
                self._client = None

    async def publish(self, report: MetricsReport) -> None:
        if self._client is None or not report.values:
            return
        from botocore.exceptions import ConnectionError, HTTPClientError

        data = [cloudwatch_datum(value, report.timestamp) for value in report.values]
        batches = cloudwatch_batches(data, self.max_datums, self.max_payload, self._namespace)
        for number, batch in enumerate(batches):
            try:
                await self._client.put_metric_data(Namespace=self._namespace, MetricData=batch)
            except (ConnectionError, HTTPClientError) as exc:
                # the endpoint is unreachable: the rest of this upload would only fail the
                # same way, one log line each (the next upload tries again)
                dropped = sum(len(rest) for rest in batches[number:])
                self.failures += 1
                self.data_dropped += dropped
                logger.warning(
                    "PutMetricData failed, %d metric data of this upload dropped (%d call(s) "
                    "not attempted): %s: %s",
                    dropped,
                    len(batches) - number - 1,
                    type(exc).__name__,
                    exc,
                )
                return
            except Exception as exc:
                self.failures += 1
                self.data_dropped += len(batch)
                logger.warning(
                    "PutMetricData failed (%d metric data dropped): %s: %s",
                    len(batch),
                    type(exc).__name__,
                    exc,
                )
            else:
                self.calls += 1
                self.data_sent += len(batch)


# --- Prometheus -----------------------------------------------------------------------------

#: Histogram bucket bounds: seconds for times, plain numbers for the per-request counts.
_SECONDS_BUCKETS: Final = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_COUNT_BUCKETS: Final = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)


def _spread(value: MetricValue, scale: float) -> list[tuple[float, float]]:
    """A statistic set as (value, how many) samples: the minimum and maximum once each, the
    rest at the value that keeps the sum exact. Count, sum, min and max stay exact; only the
    samples between min and max are placed at their mean (the KPL keeps no finer detail)."""
    count = int(value.count)
    low, high = value.min * scale, value.max * scale
    if count <= 1:
        return [(low, float(count))]
    if count == 2:
        return [(low, 1.0), (high, 1.0)]
    rest = (value.sum * scale - low - high) / (count - 2)
    return [(low, 1.0), (high, 1.0), (min(max(rest, low), high), float(count - 2))]


class _Histogram:
    __slots__ = ("buckets", "count", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.buckets = [0.0] * (len(bounds) + 1)
        self.count = 0.0
        self.sum = 0.0


class PrometheusSink:
    """Exposes the metrics in a ``prometheus_client`` registry (extra ``anykpl[prometheus]``).

    Names are the KPL's in snake_case after ``prefix`` (default ``kpl``), with Prometheus's unit
    suffixes; labels ``stream``, ``shard`` and, where a metric has one, ``error_code`` (empty
    when the dimension does not apply or ``metrics_granularity`` cuts it):

    - counters for the metrics that count events: ``kpl_user_records_put_total``,
      ``kpl_user_records_data_put_bytes_total``, ``kpl_errors_by_code_total``, ...;
    - histograms for the distributions: ``kpl_request_time_seconds``,
      ``kpl_buffering_time_seconds``, ``kpl_user_records_per_kinesis_record``, ...; their
      ``_count`` and ``_sum`` are exact, their buckets approximate (see :func:`_spread`);
    - gauges with each distribution's minimum and maximum over the last upload interval:
      ``kpl_request_time_max_seconds``, ``kpl_request_time_min_seconds``, ...

    ``registry`` defaults to ``prometheus_client.REGISTRY``, the one that
    ``start_http_server`` and ``make_wsgi_app`` serve unless told otherwise; the collector is
    registered when the sink is created and :meth:`unregister` removes it (for a notebook
    cell run again). A second sink with the same ``prefix`` on one registry is refused with a
    ``ValueError``. Values update every ``metrics_upload_delay``.

    Several producers may share one sink: counters and histograms add up. The min/max gauges
    hold, per label set, the extremes of the last report that had data for it, kept for two
    report intervals: producers writing different streams keep theirs apart, but for a label
    set two producers share, the last to report wins. Give such producers their own sink
    (each on its own registry, or with its own ``prefix``) to see their extremes apart.
    """

    def __init__(self, registry: Any = None, *, prefix: str = "kpl") -> None:
        import prometheus_client

        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", prefix):
            raise ValueError(f"invalid Prometheus metric name prefix {prefix!r}")
        self.prefix = prefix
        self.registry = prometheus_client.REGISTRY if registry is None else registry
        self._counters: dict[tuple[str, tuple[str, str, str]], float] = {}
        self._histograms: dict[tuple[str, tuple[str, str, str]], _Histogram] = {}
        #: label set -> (min, max, time of the report, how long it is shown)
        self._extremes: dict[tuple[str, tuple[str, str, str]], tuple[float, float, float, float]]
        self._extremes = {}
        try:
            self.registry.register(self)
        except ValueError as exc:
            raise ValueError(
                f"a collector with the metric names of PrometheusSink(prefix={prefix!r}) is "
                f"already registered on this registry ({exc}): share one sink between "
                "producers, unregister the old one (sink.unregister()), or use another prefix"
            ) from None

    def unregister(self) -> None:
        """Remove the sink's metrics from its registry (again: no-op). The sink can still be
        published to; nothing is exposed until it is registered again."""
        with suppress(KeyError):
            self.registry.unregister(self)

    def __repr__(self) -> str:
        return f"<PrometheusSink prefix={self.prefix!r}>"

    def open(self, config: ProducerConfig) -> AbstractAsyncContextManager[object]:
        return _nothing_to_open()

    async def publish(self, report: MetricsReport) -> None:
        now = time.monotonic()
        extremes = self._extremes
        keep = 2 * max(report.duration, 1.0)
        for key, (_, _, updated, shown) in list(extremes.items()):
            if now - updated > shown:
                del extremes[key]  # no data for two intervals
        for value in report.leaves:
            labels = (value.stream or "", value.shard or "", value.error_code or "")
            key = (value.name, labels)
            if value.name in _COUNTERS:
                self._counters[key] = self._counters.get(key, 0.0) + value.sum
                continue
            seconds = value.unit == "Milliseconds"
            scale = 0.001 if seconds else 1.0
            bounds = _SECONDS_BUCKETS if seconds else _COUNT_BUCKETS
            histogram = self._histograms.get(key)
            if histogram is None:
                histogram = self._histograms[key] = _Histogram(bounds)
            for sample, weight in _spread(value, scale):
                index = next((i for i, b in enumerate(bounds) if sample <= b), len(bounds))
                histogram.buckets[index] += weight
            histogram.count += value.count
            histogram.sum += value.sum * scale
            extremes[key] = (value.min * scale, value.max * scale, now, keep)

    def _family_name(self, metric: str) -> str:
        unit, _ = METRICS.get(metric, ("Count", "detailed"))
        name = f"{self.prefix}_{snake_case(metric)}"
        if unit == "Bytes":
            name += "_bytes"
        elif unit == "Milliseconds":
            name += "_seconds"
        return name

    def describe(self) -> list[Any]:
        """Every family the sink may expose (with no samples), so that the registry refuses a
        second collector with the same names."""
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        families: list[Any] = []
        for metric in METRICS:
            name = self._family_name(metric)
            if metric in _COUNTERS:
                families.append(CounterMetricFamily(name, f"KPL metric {metric}"))
                continue
            families.append(HistogramMetricFamily(name, f"KPL metric {metric}"))
            suffix = "_seconds" if name.endswith("_seconds") else ""
            stem = name.removesuffix("_seconds")
            for kind in ("min", "max"):
                families.append(GaugeMetricFamily(f"{stem}_{kind}{suffix}", metric))
        return families

    def collect(self) -> list[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        families: dict[str, Any] = {}
        label_names = ("stream", "shard", "error_code")
        for (metric, labels), total in sorted(self._counters.items()):
            name = self._family_name(metric)
            family = families.get(name)
            if family is None:
                family = families[name] = CounterMetricFamily(
                    name, f"KPL metric {metric}", labels=label_names
                )
            family.add_metric(list(labels), total)
        for (metric, labels), histogram in sorted(self._histograms.items()):
            name = self._family_name(metric)
            family = families.get(name)
            if family is None:
                family = families[name] = HistogramMetricFamily(
                    name, f"KPL metric {metric}", labels=label_names
                )
            bounds = _SECONDS_BUCKETS if name.endswith("_seconds") else _COUNT_BUCKETS
            cumulative, buckets = 0.0, []
            for bound, count in zip([*bounds, math.inf], histogram.buckets, strict=True):
                cumulative += count
                buckets.append(("+Inf" if bound == math.inf else repr(float(bound)), cumulative))
            family.add_metric(list(labels), buckets, histogram.sum)
        for (metric, labels), (low, high, _, _) in sorted(self._extremes.items()):
            base = self._family_name(metric)
            suffix = "_seconds" if base.endswith("_seconds") else ""
            stem = base.removesuffix("_seconds")
            for kind, value in (("min", low), ("max", high)):
                name = f"{stem}_{kind}{suffix}"
                family = families.get(name)
                if family is None:
                    family = families[name] = GaugeMetricFamily(
                        name,
                        f"KPL metric {metric}: {kind}imum over the last upload interval",
                        labels=label_names,
                    )
                family.add_metric(list(labels), value)
        return list(families.values())


# --- OpenTelemetry --------------------------------------------------------------------------

_OTEL_UNITS: Final = {"Count": "1", "Bytes": "By", "Milliseconds": "ms"}
#: ``Histogram.record`` calls between two checkpoints (about a millisecond of work).
_OTEL_RECORDS_PER_CHECKPOINT: Final = 1000


class OpenTelemetrySink:
    """Records the metrics through the OpenTelemetry metrics API (extra ``anykpl[otel]``).

    Instruments are named ``kpl.<snake_case KPL name>`` (``kpl.user_records_put``,
    ``kpl.request_time``), with units ``1``, ``By`` or ``ms``, attributes ``stream``, ``shard``
    and ``error_code`` where they apply. Metrics that count events are ``Counter`` s (each
    upload adds the interval's sum); distributions are ``Histogram`` s fed the interval's
    statistic set (count, sum, min and max exact; see :func:`_spread`). ``meter_provider``
    defaults to the global one (``opentelemetry.metrics.get_meter_provider()``).
    """

    def __init__(self, meter_provider: Any = None, *, prefix: str = "kpl") -> None:
        from opentelemetry import metrics

        provider = metrics.get_meter_provider() if meter_provider is None else meter_provider
        self.prefix = prefix
        self.meter = provider.get_meter("anykpl")
        self._instruments: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"<OpenTelemetrySink prefix={self.prefix!r}>"

    def open(self, config: ProducerConfig) -> AbstractAsyncContextManager[object]:
        return _nothing_to_open()

    def _instrument(self, value: MetricValue) -> Any:
        instrument = self._instruments.get(value.name)
        if instrument is None:
            name = f"{self.prefix}.{snake_case(value.name)}"
            unit = _OTEL_UNITS[value.unit]
            description = f"KPL metric {value.name}"
            if value.name in _COUNTERS:
                instrument = self.meter.create_counter(name, unit=unit, description=description)
            else:
                instrument = self.meter.create_histogram(name, unit=unit, description=description)
            self._instruments[value.name] = instrument
        return instrument

    async def publish(self, report: MetricsReport) -> None:
        recorded = 0
        for value in report.leaves:
            instrument = self._instrument(value)
            attributes = {
                key: dimension
                for key, dimension in (
                    ("stream", value.stream),
                    ("shard", value.shard),
                    ("error_code", value.error_code),
                )
                if dimension is not None
            }
            if value.name in _COUNTERS:
                instrument.add(value.sum, attributes)
                continue
            # one record() per sample (the API has no weighted record): let the event loop
            # run every _OTEL_RECORDS_PER_CHECKPOINT of them, or a busy interval stalls it
            for sample, weight in _spread(value, 1.0):
                for _ in range(int(weight)):
                    instrument.record(sample, attributes)
                    recorded += 1
                    if recorded >= _OTEL_RECORDS_PER_CHECKPOINT:
                        recorded = 0
                        await anyio.lowlevel.checkpoint()
        await anyio.lowlevel.checkpoint()
