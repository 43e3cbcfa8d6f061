"""KPL metrics: statistic sets, ancestors, windows, level and granularity filtering, local
queries, and the upload task that hands reports to sinks."""

from __future__ import annotations

import logging
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import datetime, timezone
from typing import Any

import anyio
import pytest

from anykpl import Producer, ProducerConfig
from anykpl._metrics import METRICS, MetricKey, Metrics, leaves, to_values, with_ancestors
from anykpl.metrics import (
    CloudWatchSink,
    MetricsReport,
    MetricsSink,
    cloudwatch_batches,
    cloudwatch_datum,
    snake_case,
)
from tests.fakes import FakeKinesis

S0 = "shardId-000000000000"
S1 = "shardId-000000000001"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_points_feed_their_ancestors() -> None:
    m = Metrics()
    m.add("UserRecordsPut", 3, "s1", S0, None)
    m.add("UserRecordsPut", 2, "s1", S1, None)
    m.add("UserRecordsPut", 5, "s2", S0, None)
    snapshot = m.snapshot()
    assert snapshot[MetricKey("UserRecordsPut")] == 10
    assert snapshot[MetricKey("UserRecordsPut", "s1")] == 5
    assert snapshot[MetricKey("UserRecordsPut", "s1", S1)] == 2
    # 3 shard-level, 2 stream-level, 1 global: the KPL's counting
    assert len([k for k in snapshot if k.name == "UserRecordsPut"]) == 6


def test_error_codes_are_a_dimension() -> None:
    m = Metrics()
    m.add("ErrorsByCode", 2, "s", S0, "ProvisionedThroughputExceededException")
    m.add("ErrorsByCode", 1, "s", None, "InternalFailure")
    assert m.by_error_code() == {
        "ProvisionedThroughputExceededException": 2,
        "InternalFailure": 1,
    }
    snapshot = m.snapshot()
    assert snapshot[MetricKey("ErrorsByCode", error_code="InternalFailure")] == 1


def test_statistic_sets_keep_count_sum_min_max() -> None:
    clock = Clock()
    m = Metrics(clock)
    m.sample("RequestTime", 40.0, "s", None, None)
    m.sample("RequestTime", 10.0, "s", None, None)
    clock.now += 5
    m.observe("RequestTime", "s", None, None, 2, 70.0, 20.0, 50.0)
    (value,) = m.query("RequestTime")[1:]  # [global, stream]
    assert (value.count, value.sum, value.min, value.max) == (4, 120.0, 10.0, 50.0)
    assert value.mean == 30.0
    assert value.stream == "s"
    assert value.unit == "Milliseconds"
    assert value.dimensions == (("StreamName", "s"),)
    assert value.duration == 5.0


def test_windows_cover_the_last_seconds() -> None:
    clock = Clock()
    m = Metrics(clock)
    m.add("UserRecordsPut", 1, "s", S0, None)
    clock.now += 30
    m.add("UserRecordsPut", 2, "s", S0, None)
    clock.now += 0.5
    m.add("UserRecordsPut", 4, "s", S0, None)
    clock.now += 0.1

    def total(window: float | None) -> float:
        return next(v.sum for v in m.query("UserRecordsPut", window) if v.stream is None)

    assert total(None) == 7
    assert total(5) == 6
    assert total(60) == 7
    clock.now += 45  # the first sample is now older than the history kept
    m.add("UserRecordsPut", 8, "s", S0, None)
    assert total(60) == 14
    assert total(None) == 15


def test_dimension_order_and_sorting() -> None:
    m = Metrics()
    m.add("ErrorsByCode", 1, "s", S0, "InternalFailure")
    values = to_values(with_ancestors(m.cumulative()), 1.0)
    assert [v.dimensions for v in values] == [
        (("ErrorCode", "InternalFailure"),),
        (("ErrorCode", "InternalFailure"), ("StreamName", "s")),
        (("ErrorCode", "InternalFailure"), ("StreamName", "s"), ("ShardId", S0)),
    ]


@pytest.mark.parametrize(
    ("level", "granularity", "expected"),
    [
        ("summary", "shard", {("UserRecordsPut", 0), ("UserRecordsPut", 1), ("UserRecordsPut", 2)}),
        ("summary", "global", {("UserRecordsPut", 0)}),
        (
            "detailed",
            "stream",
            {
                ("UserRecordsPut", 0),
                ("UserRecordsPut", 1),
                ("RequestTime", 0),
                ("RequestTime", 1),
            },
        ),
        ("none", "shard", set()),
    ],
)
def test_level_and_granularity_filter_like_the_kpl(
    level: str, granularity: str, expected: set[tuple[str, int]]
) -> None:
    m = Metrics()
    m.add("UserRecordsPut", 1, "s", S0, None)
    m.sample("RequestTime", 5.0, "s", None, None)
    values = to_values(with_ancestors(m.cumulative()), 1.0, level=level, granularity=granularity)
    depth = {"global": 0, "stream": 1, "shard": 2}
    assert {(v.name, depth[v.granularity]) for v in values} == expected


def test_leaves_count_each_sample_once() -> None:
    m = Metrics()
    m.add("UserRecordsPut", 3, "s", S0, None)
    m.add("UserRecordsPut", 4, "s", S1, None)
    cut = leaves(m.cumulative(), "stream")
    assert cut == {("UserRecordsPut", "s", None, None): [7, 7, 1.0, 1.0]}


def test_take_unsent_hands_out_each_sample_once() -> None:
    clock = Clock()
    m = Metrics(clock)
    m.enable_uploads()
    m.add("UserRecordsPut", 3, "s", S0, None)
    clock.now += 0.2
    stats, start, end = m.take_unsent()
    assert stats == {("UserRecordsPut", "s", S0, None): [3, 3, 1.0, 1.0]}
    assert end - start == pytest.approx(0.2)
    m.add("UserRecordsPut", 1, "s", S0, None)
    clock.now += 3
    m.add("UserRecordsPut", 1, "s", S0, None)
    stats, _, _ = m.take_unsent()
    assert stats[("UserRecordsPut", "s", S0, None)][0] == 2
    assert m.take_unsent()[0] == {}
    # local queries still see everything
    assert m.snapshot()[MetricKey("UserRecordsPut")] == 5


def test_every_kpl_metric_has_a_unit_and_level() -> None:
    assert METRICS["BufferingTime"] == ("Milliseconds", "summary")
    assert METRICS["UserRecordsDataPut"] == ("Bytes", "detailed")
    assert snake_case("UserRecordsPerPutRecordsRequest") == "user_records_per_put_records_request"


def test_cloudwatch_batches_respect_count_and_payload() -> None:
    m = Metrics()
    for i in range(30):
        m.add("UserRecordsPut", 1, "s", f"shardId-{i:012d}", None)
    values = to_values(with_ancestors(m.cumulative()), 1.0)
    assert len(values) == 32
    data = [cloudwatch_datum(v, datetime.now(timezone.utc)) for v in values]
    batches = cloudwatch_batches(data)
    assert [len(b) for b in batches] == [20, 12]
    small = cloudwatch_batches(data, max_payload=2000)
    assert all(len(b) <= 5 for b in small)
    assert sum(len(b) for b in small) == 32
    assert data[-1]["StatisticValues"] == {
        "SampleCount": 1.0,
        "Sum": 1.0,
        "Minimum": 1.0,
        "Maximum": 1.0,
    }


def test_bad_sinks_are_rejected() -> None:
    with pytest.raises(TypeError, match="MetricsSink"):
        Producer(metrics_sinks=[object()])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="namespace"):
        CloudWatchSink(namespace="AWS/Kinesis")


class RecordingSink:
    def __init__(self, fail: bool = False) -> None:
        self.reports: list[MetricsReport] = []
        self.fail = fail
        self.opened = self.closed = 0

    @asynccontextmanager
    async def _open(self) -> Any:
        self.opened += 1
        try:
            yield
        finally:
            self.closed += 1

    def open(self, config: ProducerConfig) -> AbstractAsyncContextManager[object]:
        return self._open()

    async def publish(self, report: MetricsReport) -> None:
        if self.fail:
            raise RuntimeError("sink down")
        self.reports.append(report)


FAST = {"record_max_buffered_time": 0.01, "metrics_upload_delay": 0.05}


async def _put_some(producer: Producer, count: int = 10) -> None:
    for i in range(count):
        await producer.put_record("stream", b"data", partition_key=f"k{i}")


@pytest.mark.anyio
async def test_sinks_get_reports_and_a_final_one() -> None:
    sink = RecordingSink()
    assert isinstance(sink, MetricsSink)
    async with Producer(transport=FakeKinesis(), metrics_sinks=[sink], **FAST) as producer:
        await _put_some(producer)
        await anyio.sleep(0.12)
        assert sink.reports
    assert sink.reports[-1].final
    assert sink.opened == sink.closed == 1
    put = [v for r in sink.reports for v in r.values if v.name == "UserRecordsPut"]
    assert sum(v.sum for v in put if v.granularity == "global") == 10
    received = [v for r in sink.reports for v in r.leaves if v.name == "UserRecordsReceived"]
    assert sum(v.sum for v in received) == 10
    shards = {v.shard for r in sink.reports for v in r.leaves if v.name == "UserRecordsPut"}
    assert shards
    assert None not in shards
    names = {v.name for r in sink.reports for v in r.values}
    assert {
        "RequestTime",
        "BufferingTime",
        "KinesisRecordsPut",
        "KinesisRecordsDataPut",
        "UserRecordsDataPut",
        "UserRecordsPerKinesisRecord",
        "KinesisRecordsPerPutRecordsRequest",
        "UserRecordsPerPutRecordsRequest",
    } <= names


@pytest.mark.anyio
async def test_summary_level_at_stream_granularity() -> None:
    sink = RecordingSink()
    async with Producer(
        transport=FakeKinesis(),
        metrics_sinks=[sink],
        metrics_level="summary",
        metrics_granularity="stream",
        **FAST,
    ) as producer:
        await _put_some(producer)
    values = [v for r in sink.reports for v in r.values]
    assert values
    assert {v.level for v in values} == {"summary"}
    assert all(v.shard is None for v in values)
    assert {v.granularity for v in values} == {"global", "stream"}


@pytest.mark.anyio
async def test_level_none_runs_no_upload_task() -> None:
    sink = RecordingSink()
    async with Producer(
        transport=FakeKinesis(), metrics_sinks=[sink], metrics_level="none", **FAST
    ) as producer:
        await _put_some(producer)
        assert producer._uploader is None
        # local metrics still work, as in the KPL
        assert producer.metrics("UserRecordsPut")
    assert sink.reports == []
    assert sink.opened == 0


@pytest.mark.anyio
async def test_a_failing_sink_is_logged_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    bad, good = RecordingSink(fail=True), RecordingSink()
    with caplog.at_level(logging.ERROR, logger="anykpl.metrics"):
        async with Producer(transport=FakeKinesis(), metrics_sinks=[bad, good], **FAST) as producer:
            await _put_some(producer)
            await anyio.sleep(0.12)
            uploader = producer._uploader
            assert uploader is not None
    assert uploader.failures[0] >= 2
    assert uploader.failures[1] == 0
    assert good.reports[-1].final
    assert "failed to publish" in caplog.text


@pytest.mark.anyio
async def test_no_sinks_no_task_no_upload_bookkeeping() -> None:
    async with Producer(transport=FakeKinesis(), **FAST) as producer:
        await _put_some(producer)
        assert producer._uploader is None
        assert producer._metrics._unsent is None


@pytest.mark.anyio
async def test_producer_metrics_like_get_metrics() -> None:
    async with Producer(transport=FakeKinesis(), **FAST) as producer:
        await _put_some(producer, 20)
        everything = producer.metrics()
        put = producer.metrics("UserRecordsPut")
        recent = producer.metrics("UserRecordsPut", window=60)
        with pytest.raises(ValueError, match="window"):
            producer.metrics(window=0)
        with pytest.raises(ValueError, match="window"):
            producer.metrics(window=61)
    assert {v.name for v in put} == {"UserRecordsPut"}
    (total,) = [v for v in put if v.granularity == "global"]
    assert (total.count, total.sum, total.min, total.max, total.mean) == (20, 20, 1, 1, 1)
    assert [v.sum for v in recent if v.granularity == "global"] == [20]
    received = [v for v in everything if v.name == "UserRecordsReceived"]
    assert {v.granularity for v in received} == {"global", "stream"}
    assert all(v.sum == 20 for v in received)
    request_time = [v for v in everything if v.name == "RequestTime"]
    assert request_time
    assert all(0 <= v.min <= v.mean <= v.max for v in request_time)


@pytest.mark.anyio
async def test_prometheus_and_otel_sinks_map_names() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from anykpl.metrics import OpenTelemetrySink, PrometheusSink

    registry = prometheus_client.CollectorRegistry()
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    sinks = [PrometheusSink(registry), OpenTelemetrySink(provider)]
    async with Producer(transport=FakeKinesis(), metrics_sinks=sinks, **FAST) as producer:
        await _put_some(producer)
    total = 0.0
    for shard in (S0, S1, "shardId-000000000002", "shardId-000000000003"):
        total += (
            registry.get_sample_value(
                "kpl_user_records_put_total",
                {"stream": "stream", "shard": shard, "error_code": ""},
            )
            or 0.0
        )
    assert total == 10
    count = registry.get_sample_value(
        "kpl_request_time_seconds_count", {"stream": "stream", "shard": "", "error_code": ""}
    )
    assert count is not None
    assert count >= 1
    data = reader.get_metrics_data()
    names = {m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert {"kpl.user_records_put", "kpl.request_time"} <= names
    provider.shutdown()
