"""The Prometheus sink: :class:`PrometheusSink`, a collector on a ``prometheus_client``
registry (extra ``anykpl[prometheus]``, imported when the sink is created).

Prometheus aggregates labels itself, so the sink reads each report's ``leaves`` (every sample
once, at the deepest level allowed) and keeps running counters and histograms across reports;
the KPL has no counterpart.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager, suppress
from typing import TYPE_CHECKING, Any, Final

from .._core._metrics import METRICS
from ._sink import COUNTERS, MetricsReport, nothing_to_open, snake_case, spread

if TYPE_CHECKING:
    from ..config import ProducerConfig

__all__ = ("PrometheusSink",)


#: Histogram bucket bounds: seconds for times, plain numbers for the per-request counts.
_SECONDS_BUCKETS: Final = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_COUNT_BUCKETS: Final = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)


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
      ``_count`` and ``_sum`` are exact, their buckets approximate (see :func:`spread`);
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
        return nothing_to_open()

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
            if value.name in COUNTERS:
                self._counters[key] = self._counters.get(key, 0.0) + value.sum
                continue
            seconds = value.unit == "Milliseconds"
            scale = 0.001 if seconds else 1.0
            bounds = _SECONDS_BUCKETS if seconds else _COUNT_BUCKETS
            histogram = self._histograms.get(key)
            if histogram is None:
                histogram = self._histograms[key] = _Histogram(bounds)
            for sample, weight in spread(value, scale):
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
            if metric in COUNTERS:
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
