"""The OpenTelemetry sink: :class:`OpenTelemetrySink`, counters and histograms through the
OpenTelemetry metrics API (extra ``anykpl[otel]``, imported when the sink is created).

Like Prometheus, OpenTelemetry aggregates attributes itself, so the sink reads each report's
``leaves``; the SDK or a distro chooses the exporter. The KPL has no counterpart.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Final

import anyio

from .._core._metrics import MetricValue
from ._sink import COUNTERS, MetricsReport, nothing_to_open, snake_case, spread

if TYPE_CHECKING:
    from ..config import ProducerConfig

__all__ = ("OpenTelemetrySink",)


_OTEL_UNITS: Final = {"Count": "1", "Bytes": "By", "Milliseconds": "ms"}
#: ``Histogram.record`` calls between two checkpoints (about a millisecond of work).
_OTEL_RECORDS_PER_CHECKPOINT: Final = 1000


class OpenTelemetrySink:
    """Records the metrics through the OpenTelemetry metrics API (extra ``anykpl[otel]``).

    Instruments are named ``kpl.<snake_case KPL name>`` (``kpl.user_records_put``,
    ``kpl.request_time``), with units ``1``, ``By`` or ``ms``, attributes ``stream``, ``shard``
    and ``error_code`` where they apply. Metrics that count events are ``Counter`` s (each
    upload adds the interval's sum); distributions are ``Histogram`` s fed the interval's
    statistic set (count, sum, min and max exact; see :func:`spread`). ``meter_provider``
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
        return nothing_to_open()

    def _instrument(self, value: MetricValue) -> Any:
        instrument = self._instruments.get(value.name)
        if instrument is None:
            name = f"{self.prefix}.{snake_case(value.name)}"
            unit = _OTEL_UNITS[value.unit]
            description = f"KPL metric {value.name}"
            if value.name in COUNTERS:
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
            if value.name in COUNTERS:
                instrument.add(value.sum, attributes)
                continue
            # one record() per sample (the API has no weighted record): let the event loop
            # run every _OTEL_RECORDS_PER_CHECKPOINT of them, or a busy interval stalls it
            for sample, weight in spread(value, 1.0):
                for _ in range(int(weight)):
                    instrument.record(sample, attributes)
                    recorded += 1
                    if recorded >= _OTEL_RECORDS_PER_CHECKPOINT:
                        recorded = 0
                        await anyio.lowlevel.checkpoint()
        await anyio.lowlevel.checkpoint()
