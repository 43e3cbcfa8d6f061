"""What a sink is and what it receives: the :class:`MetricsSink` protocol and the
:class:`MetricsReport` handed to it at each upload.

This is the whole contract between the producer's upload task (``_uploader.py``) and the sinks
(``_cloudwatch.py``, ``_prometheus.py``, ``_opentelemetry.py``, or a user's own): the task builds
reports and calls ``open`` and ``publish``, a sink reads reports, and neither knows the other's
insides. So a sink changes in its own file, and a new one needs nothing but this module.

After the contract, what the shipped sinks share: :data:`COUNTERS` (the metrics that count
events), :func:`snake_case` (the KPL's names as Prometheus and OpenTelemetry spell them),
:func:`nothing_to_open` (``open`` for a sink without a client) and :func:`spread` (a statistic
set as weighted samples, for the sinks that keep histograms).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Final, Protocol, runtime_checkable

from .._core._metrics import MetricValue

if TYPE_CHECKING:
    from ..config import ProducerConfig

__all__ = (
    "COUNTERS",
    "MetricsReport",
    "MetricsSink",
    "nothing_to_open",
    "snake_case",
    "spread",
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


#: Metrics that count events (their sum is what matters): counters in Prometheus and
#: OpenTelemetry. The rest are distributions (histograms).
COUNTERS: Final = frozenset(
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


def snake_case(name: str) -> str:
    """``UserRecordsPerPutRecordsRequest`` → ``user_records_per_put_records_request``."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


@asynccontextmanager
async def nothing_to_open() -> AsyncIterator[None]:
    yield


def spread(value: MetricValue, scale: float) -> list[tuple[float, float]]:
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
