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

Layout (one job per module; import the public names from here):

- ``_sink.py``: the contract — :class:`MetricsSink`, :class:`MetricsReport` — and the helpers
  the shipped sinks share;
- ``_uploader.py``: the producer's upload task and its time bounds (:data:`PUBLISH_TIMEOUT`,
  :data:`CLOSE_GRACE`, :data:`FINAL_REPORT_WHEN_CANCELLED`);
- ``_cloudwatch.py``, ``_prometheus.py``, ``_opentelemetry.py``: one sink each.

Each sink is a feature beyond the pipeline with a dependency of its own, and meets the upload
task only through the protocol, so a sink changes in its own file. The counters themselves
(the KPL's ``metrics_manager``: statistic sets in one-second buckets, local queries) are not
here but in ``anykpl/_core/_metrics.py``: the pipeline records into them whether or not anything is
uploaded, and the core does not depend on the sinks.
"""

from .._core._metrics import MetricValue
from ._cloudwatch import CloudWatchSink
from ._opentelemetry import OpenTelemetrySink
from ._prometheus import PrometheusSink
from ._sink import MetricsReport, MetricsSink
from ._uploader import CLOSE_GRACE, FINAL_REPORT_WHEN_CANCELLED, PUBLISH_TIMEOUT

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

# the classes keep the name users import them by (in reprs, pickles and tracebacks), as they
# had before this package was split; MetricValue is anykpl's (renamed in anykpl/__init__.py)
for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith(__name__ + "._"):
        _obj.__module__ = __name__
del _name, _obj
