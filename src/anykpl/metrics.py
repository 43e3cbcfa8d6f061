"""Metrics out of the process: the :class:`MetricsSink` protocol and the sinks that ship.

A producer given sinks (``Producer(..., metrics_sinks=[...])``) runs one upload task in its
task group. Every ``metrics_upload_delay`` seconds the task takes the statistics accumulated
since the previous upload (count, sum, min and max per metric and dimensions), filters them by
``metrics_level`` and ``metrics_granularity`` as the KPL does, and hands one
:class:`MetricsReport` to each sink. A last report goes out when the producer closes (bounded
by ``close_timeout``). A sink that fails is logged on the ``anykpl.metrics`` logger and
counted; it never reaches the pipeline. Without sinks no task runs and nothing extra is done.

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
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Final, Protocol, runtime_checkable

import anyio

from ._metrics import METRICS, Metrics, MetricValue, leaves, to_values, with_ancestors

if TYPE_CHECKING:
    from .config import ProducerConfig

__all__ = (
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
      logged and counted, and the next report comes as usual.
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


class Uploader:
    """The producer's upload task: one per producer, only when sinks are configured."""

    def __init__(
        self,
        metrics: Metrics,
        sinks: Sequence[MetricsSink],
        config: ProducerConfig,
        before_take: Callable[[], None],
    ) -> None:
        self.metrics = metrics
        self.sinks = tuple(sinks)
        self.config = config
        self.before_take = before_take
        self.uploads = 0
        #: failed ``publish`` (or ``open``) calls, per sink index
        self.failures = [0] * len(self.sinks)
        self._stop = anyio.Event()
        self._done = anyio.Event()
        metrics.enable_uploads()

    async def run(self) -> None:
        opened: list[MetricsSink] = []
        try:
            async with AsyncExitStack() as stack:
                try:
                    for index, sink in enumerate(self.sinks):
                        try:
                            await stack.enter_async_context(sink.open(self.config))
                        except anyio.get_cancelled_exc_class():
                            raise
                        except Exception:
                            self.failures[index] += 1
                            logger.exception("metrics sink %r failed to open", sink)
                        else:
                            opened.append(sink)
                    final = False
                    while not final:
                        with anyio.move_on_after(self.config.metrics_upload_delay):
                            await self._stop.wait()
                        final = self._stop.is_set()
                        await self._publish(opened, final=final)
                finally:
                    # close the sinks' clients even when cancelled, briefly
                    with anyio.move_on_after(5, shield=True):
                        await stack.aclose()
        finally:
            self._done.set()

    async def close(self) -> None:
        """Send the final report and close the sinks (the producer bounds this)."""
        self._stop.set()
        await self._done.wait()

    def report(self, *, final: bool) -> MetricsReport:
        self.before_take()
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

    async def _publish(self, sinks: Sequence[MetricsSink], *, final: bool) -> None:
        report = self.report(final=final)
        self.uploads += 1
        for sink in sinks:
            try:
                await sink.publish(report)
            except anyio.get_cancelled_exc_class():
                raise
            except Exception:
                self.failures[self.sinks.index(sink)] += 1
                logger.exception("metrics sink %r failed to publish", sink)


# --- CloudWatch -----------------------------------------------------------------------------

#: The KPL's limits per PutMetricData call (metrics_manager.cc): at most 20 metric data and
#: about 38 KiB of payload. CloudWatch now accepts 1000 data and 1 MB, but these work with every
#: endpoint (older regions, emulators) and keep each call small.
CLOUDWATCH_MAX_DATUMS: Final = 20
CLOUDWATCH_MAX_PAYLOAD: Final = 38 * 1024


def _estimated_size(datum: Mapping[str, Any]) -> int:
    """A generous estimate of a datum's encoded size (the query protocol's form encoding, the
    largest of CloudWatch's encodings)."""
    size = 200 + 3 * len(datum["MetricName"])
    for dimension in datum.get("Dimensions", ()):
        size += 80 + 3 * (len(dimension["Name"]) + len(dimension["Value"]))
    return size


def cloudwatch_batches(
    data: Sequence[Mapping[str, Any]],
    max_datums: int = CLOUDWATCH_MAX_DATUMS,
    max_payload: int = CLOUDWATCH_MAX_PAYLOAD,
) -> list[list[Mapping[str, Any]]]:
    """Split metric data into PutMetricData calls of ≤ ``max_datums`` and ≤ ``max_payload``."""
    batches: list[list[Mapping[str, Any]]] = []
    batch: list[Mapping[str, Any]] = []
    size = 0
    for datum in data:
        datum_size = _estimated_size(datum)
        if batch and (len(batch) >= max_datums or size + datum_size > max_payload):
            batches.append(batch)
            batch, size = [], 0
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

    Attributes:
        calls: successful PutMetricData calls.
        failures: failed PutMetricData calls.
        data_sent: metric data uploaded.
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
        self._client: Any = None
        self._namespace = namespace or "KinesisProducerLibrary"

    def __repr__(self) -> str:
        return f"<CloudWatchSink namespace={self._namespace!r} endpoint={self.endpoint_url!r}>"

    @asynccontextmanager
    async def open(self, config: ProducerConfig) -> AsyncIterator[None]:
        from aiobotocore.config import AioConfig
        from aiobotocore.session import AioSession

        from ._sender import _running_trio

        self._namespace = self.namespace or config.metrics_namespace
        backend = config.http_backend
        if backend == "auto":
            backend = "httpx" if _running_trio() else "aiohttp"
        options: dict[str, Any] = {
            "max_pool_connections": 2,
            "connect_timeout": config.connect_timeout,
            "read_timeout": config.request_timeout,
            "retries": {"max_attempts": 3, "mode": "standard"},
        }
        if backend == "httpx":
            from aiobotocore.httpxsession import HttpxSession

            options["http_session_cls"] = HttpxSession
        session = AioSession(profile=config.profile)
        async with session.create_client(
            "cloudwatch",
            region_name=self.region or config.region,
            endpoint_url=self.endpoint_url,
            aws_access_key_id=config.aws_access_key_id,
            aws_secret_access_key=config.aws_secret_access_key,
            aws_session_token=config.aws_session_token,
            verify=config.verify_certificate,
            config=AioConfig(**options),
        ) as client:
            self._client = client
            try:
                yield
            finally:
                self._client = None

    async def publish(self, report: MetricsReport) -> None:
        if self._client is None or not report.values:
            return
        data = [cloudwatch_datum(value, report.timestamp) for value in report.values]
        for batch in cloudwatch_batches(data, self.max_datums, self.max_payload):
            try:
                await self._client.put_metric_data(Namespace=self._namespace, MetricData=batch)
            except anyio.get_cancelled_exc_class():
                raise
            except Exception as exc:
                self.failures += 1
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
    registered when the sink is created. Several producers may share one sink (their values
    add up); two sinks on one registry clash, as any duplicate collector does. Values update
    every ``metrics_upload_delay``.
    """

    def __init__(self, registry: Any = None, *, prefix: str = "kpl") -> None:
        import prometheus_client

        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", prefix):
            raise ValueError(f"invalid Prometheus metric name prefix {prefix!r}")
        self.prefix = prefix
        self.registry = prometheus_client.REGISTRY if registry is None else registry
        self._counters: dict[tuple[str, tuple[str, str, str]], float] = {}
        self._histograms: dict[tuple[str, tuple[str, str, str]], _Histogram] = {}
        self._extremes: dict[tuple[str, tuple[str, str, str]], tuple[float, float]] = {}
        self.registry.register(self)

    def __repr__(self) -> str:
        return f"<PrometheusSink prefix={self.prefix!r}>"

    def open(self, config: ProducerConfig) -> AbstractAsyncContextManager[object]:
        return _nothing_to_open()

    async def publish(self, report: MetricsReport) -> None:
        extremes: dict[tuple[str, tuple[str, str, str]], tuple[float, float]] = {}
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
            extremes[key] = (value.min * scale, value.max * scale)
        self._extremes = extremes

    def _family_name(self, metric: str) -> str:
        unit, _ = METRICS.get(metric, ("Count", "detailed"))
        name = f"{self.prefix}_{snake_case(metric)}"
        if unit == "Bytes":
            name += "_bytes"
        elif unit == "Milliseconds":
            name += "_seconds"
        return name

    def describe(self) -> list[Any]:
        return []  # families appear with their first sample

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
        for (metric, labels), (low, high) in sorted(self._extremes.items()):
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
            for sample, weight in _spread(value, 1.0):
                for _ in range(int(weight)):
                    instrument.record(sample, attributes)
            await anyio.lowlevel.checkpoint()
