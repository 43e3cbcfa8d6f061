"""KPL metrics: statistic sets, ancestors, windows, level and granularity filtering, local
queries, and the upload task that hands reports to sinks."""

from __future__ import annotations

import ast
import inspect
import logging
import pickle
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import anyio
import pytest

import anykpl.metrics
from anykpl import Producer, ProducerConfig
from anykpl._core._metrics import METRICS, MetricKey, Metrics, leaves, to_values, with_ancestors
from anykpl.errors import RecordFailedError
from anykpl.metrics import (
    CLOSE_GRACE,
    FINAL_REPORT_WHEN_CANCELLED,
    CloudWatchSink,
    MetricsReport,
    MetricsSink,
)
from anykpl.metrics._cloudwatch import (
    CLOUDWATCH_MAX_PAYLOAD,
    cloudwatch_batches,
    cloudwatch_datum,
    estimated_size,
    request_size,
)
from anykpl.metrics._sink import snake_case
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


def test_gauges_are_sampled_once_as_each_second_closes() -> None:
    """UserRecordsPending is a gauge: one sample per stream as each one-second bucket closes
    (the KPL takes five a second), never one per read."""
    clock = Clock()
    m = Metrics(clock)
    pending = {"a": 3, "b": 0}
    m.gauge = lambda: [m.sample_to_bucket("UserRecordsPending", n, s) for s, n in pending.items()]
    m.add("UserRecordsPut", 1, "a", S0, None)  # the first bucket opens: nothing to sample yet
    assert m.query("UserRecordsPending") == []
    clock.now += 1.0
    m.add("UserRecordsPut", 1, "a", S0, None)  # the first second closes: a sample each
    pending["a"] = 7
    clock.now += 1.0
    for _ in range(3):  # reads in the same second add no sample
        values = {v.stream: v for v in m.query("UserRecordsPending") if v.stream is not None}
    assert {s: (v.count, v.min, v.max) for s, v in values.items()} == {
        "a": (2, 3, 7),
        "b": (2, 0, 0),
    }
    # uploads close buckets more often than once a second: still one sample a second
    m.enable_uploads()
    for _ in range(4):
        clock.now += 0.1
        m.take_unsent()
        m.add("UserRecordsPut", 1, "a", S0, None)
    counts = {v.stream: v.count for v in m.query("UserRecordsPending") if v.stream is not None}
    assert counts == {"a": 2, "b": 2}
    clock.now += 1.0
    m.take_unsent()
    counts = {v.stream: v.count for v in m.query("UserRecordsPending") if v.stream is not None}
    assert counts == {"a": 3, "b": 3}
    assert METRICS["UserRecordsPending"] == ("Count", "detailed")


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


def test_the_public_names_stay_where_users_import_them() -> None:
    # anykpl.metrics is a package of private modules: its names, and the module its classes
    # claim (reprs, pickles, tracebacks), are what they were when it was one file
    assert anykpl.metrics.__all__ == (
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
    for name in anykpl.metrics.__all__:
        obj = getattr(anykpl.metrics, name)
        if inspect.isclass(obj):
            expected = "anykpl" if name == "MetricValue" else "anykpl.metrics"  # also in anykpl
            assert obj.__module__ == expected, name
    assert pickle.loads(pickle.dumps(CloudWatchSink(namespace="App"))).namespace == "App"


def test_a_cloudwatch_sinks_own_credentials_are_checked_and_kept_out_of_repr() -> None:
    with pytest.raises(ValueError, match="together"):
        CloudWatchSink(aws_access_key_id="AKID")
    with pytest.raises(ValueError, match="together"):
        CloudWatchSink(aws_secret_access_key="secret")
    with pytest.raises(ValueError, match="needs its keys"):
        CloudWatchSink(aws_session_token="token")
    with pytest.raises(ValueError, match="profile must be a non-empty string"):
        CloudWatchSink(profile="")
    sink = CloudWatchSink(
        aws_access_key_id="AKID", aws_secret_access_key="s3cret", aws_session_token="t0ken"
    )
    assert "s3cret" not in repr(sink)
    assert "t0ken" not in repr(sink)


def test_no_metrics_module_imports_another_modules_private_name() -> None:
    package = Path(anykpl.metrics.__file__).parent
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports {private} from {node.module}"


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
        # a report comes every upload interval while the producer runs (waited for, not
        # timed: a busy machine may be late by more than an interval)
        with anyio.fail_after(5):
            while not sink.reports:  # noqa: ASYNC110 (the sink's reports)
                await anyio.sleep(0.01)
        assert not sink.reports[0].final
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


# -- sinks that hang, closes that are cancelled (review findings 1 and 2) -------------------


class HangingSink(RecordingSink):
    """A sink whose ``publish`` (and, with ``hang_on_close``, closing) never returns."""

    def __init__(self, *, hang_on_close: bool = False) -> None:
        super().__init__()
        self.hang_on_close = hang_on_close
        self.calls = 0

    @asynccontextmanager
    async def _open(self) -> Any:
        self.opened += 1
        try:
            yield
        finally:
            self.closed += 1
            if self.hang_on_close:
                await anyio.sleep_forever()

    async def publish(self, report: MetricsReport) -> None:
        self.calls += 1
        await anyio.sleep_forever()


@pytest.mark.anyio
async def test_a_hanging_sink_does_not_stall_the_others() -> None:
    hanging, good = HangingSink(), RecordingSink()
    async with Producer(
        transport=FakeKinesis(), metrics_sinks=[hanging, good], close_timeout=0.5, **FAST
    ) as producer:
        await _put_some(producer)
        await anyio.sleep(0.3)
        assert len(good.reports) >= 2  # every 0.05 s, the hanging sink notwithstanding
        uploader = producer._uploader
        assert uploader is not None
        closing = anyio.current_time()
    elapsed = anyio.current_time() - closing
    assert good.reports[-1].final
    assert hanging.calls >= 3
    assert uploader.failures[0] >= 2  # timed out, counted
    assert uploader.failures[1] == 0
    assert elapsed < 0.5 + CLOSE_GRACE
    put = [v for r in good.reports for v in r.values if v.name == "UserRecordsPut"]
    assert sum(v.sum for v in put if v.granularity == "global") == 10


@pytest.mark.anyio
async def test_a_failed_close_still_sends_the_final_report(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The block is left by cancellation (as SyncProducer.close(timeout=...) leaves it) while
    # records hang: they fail with ProducerClosed, and the last report must say so.
    fake = FakeKinesis()
    sink = RecordingSink()
    with anyio.move_on_after(0.3):
        async with Producer(
            transport=fake, metrics_sinks=[sink], close_timeout=5.0, **FAST
        ) as producer:
            await _put_some(producer, 3)
            fake.hang = True
            for i in range(5):
                await producer.submit("stream", b"late", partition_key=f"late{i}")
            await anyio.sleep_forever()
    assert sink.reports[-1].final
    failed = [
        v
        for v in sink.reports[-1].values
        if v.name == "UserRecordsFailed" and v.granularity == "global"
    ]
    assert [(v.error_code, v.sum) for v in failed] == [("ProducerClosed", 5)]
    assert sink.closed == 1


@pytest.mark.anyio
@pytest.mark.autojump
class TestCloseOnMockClock:
    async def test_close_takes_at_most_close_timeout_plus_a_constant(self) -> None:
        # Everything hangs: PutRecords (the flush uses all of close_timeout), one sink's
        # publish and its close. The other sink still gets the final report.
        fake = FakeKinesis()
        hanging, good = HangingSink(hang_on_close=True), RecordingSink()
        async with Producer(
            transport=fake,
            metrics_sinks=[good, hanging],
            close_timeout=1.0,
            record_max_buffered_time=0.01,
            metrics_upload_delay=60.0,
        ) as producer:
            fake.hang = True
            await _put_some_nowait(producer, 5)
            await anyio.sleep(0.1)
            closing = anyio.current_time()
        elapsed = anyio.current_time() - closing
        assert 1.0 <= elapsed <= 1.0 + CLOSE_GRACE
        assert good.reports[-1].final
        assert good.closed == hanging.closed == 1
        failed = [v for v in good.reports[-1].values if v.name == "UserRecordsFailed"]
        assert failed

    async def test_a_cancelled_close_sends_the_final_report_briefly(self) -> None:
        fake = FakeKinesis()
        hanging, good = HangingSink(), RecordingSink()
        with anyio.CancelScope() as scope:
            async with Producer(
                transport=fake, metrics_sinks=[hanging, good], close_timeout=30.0, **FAST
            ) as producer:
                fake.hang = True
                await _put_some_nowait(producer, 5)
                await anyio.sleep(0.1)
                scope.cancel()
                closing = anyio.current_time()
                await anyio.sleep_forever()
        elapsed = anyio.current_time() - closing
        assert elapsed <= FINAL_REPORT_WHEN_CANCELLED + CLOSE_GRACE
        assert good.reports[-1].final

    async def test_received_records_are_dated_by_their_second(self) -> None:
        async with Producer(transport=FakeKinesis(), **FAST) as producer:
            await _put_some(producer, 100)

            def received(window: float | None) -> float:
                values = producer.metrics("UserRecordsReceived", window=window)
                return sum(v.sum for v in values if v.granularity == "global")

            assert received(1) == 100
            await anyio.sleep(3)
            assert received(1) == 0
            assert received(5) == 100
            assert received(None) == 100
            await _put_some(producer, 7)
            assert received(1) == 7
            await anyio.sleep(2.5)  # one-second buckets: past the bucket the 7 fell in
            assert received(1) == 0
            assert received(4) == 7
            assert received(None) == 107


async def _put_some_nowait(producer: Producer, count: int) -> None:
    for i in range(count):
        await producer.submit("stream", b"data", partition_key=f"k{i}")


def test_metrics_and_statistics_after_trio_run_returns() -> None:
    import trio

    producer = Producer(transport=FakeKinesis(), **FAST)

    async def main() -> None:
        async with producer:
            await _put_some(producer, 4)

    trio.run(main)
    put = [v for v in producer.metrics("UserRecordsPut") if v.granularity == "global"]
    assert [v.sum for v in put] == [4]
    assert producer.metrics("UserRecordsPut", window=60)
    assert producer.statistics().metrics[MetricKey("UserRecordsPut")] == 4


# -- the KPL's zero samples and shard granularity (finding 6) -------------------------------


@pytest.mark.anyio
async def test_failures_are_zero_samples_per_shard_like_the_kpl() -> None:
    fake = FakeKinesis()
    # every record of shard 0 fails for good
    fake.entry_error = lambda shard, _: ("AccessDeniedException", "no") if shard == S0 else None
    async with Producer(transport=fake, **FAST) as producer:
        pendings = [
            await producer.submit("stream", b"data", partition_key=f"k{i}") for i in range(40)
        ]
        await producer.flush()
    failed = 0
    for pending in pendings:
        try:
            await pending
        except RecordFailedError:
            failed += 1
    assert 0 < failed < 40
    values = producer.metrics()

    def one(name: str, shard: str | None = None) -> Any:
        (value,) = [
            v for v in values if v.name == name and v.shard == shard and (shard or v.stream is None)
        ]
        return value

    put = one("UserRecordsPut")
    assert (put.count, put.sum, put.min, put.max) == (40, 40 - failed, 0, 1)
    assert one("UserRecordsPut", S0).sum == 0
    assert one("UserRecordsPut", S0).count == failed
    kinesis = one("KinesisRecordsPut", S0)  # per predicted shard now
    assert (kinesis.sum, kinesis.max) == (0, 0)
    errors = one("AllErrors")
    assert errors.min == 0
    assert errors.max == 1
    assert errors.sum == one("AllErrors", S0).count  # shard 0: only errors
    assert one("AllErrors", S1).sum == 0
    for name in ("KinesisRecordsDataPut", "BufferingTime", "UserRecordsPerKinesisRecord"):
        assert any(v.name == name and v.shard == S1 for v in values), name
    assert one("UserRecordsFailed", S0).sum == failed


# -- OpenTelemetry yields while it records (finding 3) --------------------------------------


class _TickingInstrument:
    def __init__(self, ticks: list[int]) -> None:
        self.ticks = ticks
        self.seen: list[int] = []

    def add(self, value: float, attributes: Any) -> None:
        pass

    def record(self, value: float, attributes: Any) -> None:
        self.seen.append(self.ticks[0])


class _Meter:
    def __init__(self, ticks: list[int]) -> None:
        self.histogram = _TickingInstrument(ticks)

    def create_counter(self, *args: Any, **kwargs: Any) -> Any:
        return _TickingInstrument([0])

    def create_histogram(self, *args: Any, **kwargs: Any) -> Any:
        return self.histogram


@pytest.mark.anyio
async def test_opentelemetry_sink_lets_the_event_loop_run() -> None:
    pytest.importorskip("opentelemetry")
    from anykpl.metrics import OpenTelemetrySink

    ticks = [0]
    meter = _Meter(ticks)

    class Provider:
        def get_meter(self, name: str) -> Any:
            return meter

    sink = OpenTelemetrySink(Provider())
    m = Metrics()
    m.observe("RequestTime", "s", None, None, 5000, 50000.0, 1.0, 20.0)
    stats = m.cumulative()
    report = MetricsReport(
        datetime.now(timezone.utc), 1.0, (), to_values(leaves(stats, "shard"), 1.0)
    )
    done = False

    async def tick() -> None:
        while not done:
            ticks[0] += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(tick)
        await anyio.lowlevel.checkpoint()
        await sink.publish(report)
        done = True
    assert len(meter.histogram.seen) == 5000
    # a checkpoint every 1000 records (trio does not run the ticker at every one)
    assert len(set(meter.histogram.seen)) >= 3


# -- Prometheus: duplicates, unregister, shared sinks (finding 7) ---------------------------


def _report(*values: tuple[str, str, float, float], duration: float = 1.0) -> MetricsReport:
    m = Metrics()
    for name, stream, low, high in values:
        m.observe(name, stream, None, None, 2, low + high, low, high)
    out = to_values(leaves(m.cumulative(), "shard"), duration)
    return MetricsReport(datetime.now(timezone.utc), duration, out, out)


@pytest.mark.anyio
async def test_prometheus_sink_refuses_a_duplicate_and_unregisters() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from anykpl.metrics import PrometheusSink

    registry = prometheus_client.CollectorRegistry()
    first = PrometheusSink(registry)
    with pytest.raises(ValueError, match="already registered"):
        PrometheusSink(registry)
    other = PrometheusSink(registry, prefix="other")  # another prefix is fine
    first.unregister()
    first.unregister()  # idempotent
    second = PrometheusSink(registry)  # a notebook cell run again
    # two producers sharing a sink, on different streams: both keep their extremes
    await second.publish(_report(("RequestTime", "a", 10.0, 30.0)))
    await second.publish(_report(("RequestTime", "b", 1.0, 2.0)))
    await other.publish(_report(("UserRecordsPut", "a", 1.0, 1.0)))
    text = prometheus_client.generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}  # parses: no dupes
    maxima = {s.labels["stream"]: s.value for s in families["kpl_request_time_max_seconds"].samples}
    assert maxima == {"a": 0.03, "b": 0.002}
    assert text.count("# TYPE kpl_request_time_seconds histogram") == 1


# -- CloudWatch: payload size and connection failures (finding 8) ---------------------------


def _query_body_size(namespace: str, batch: list[Any]) -> int:
    from urllib.parse import urlencode

    import botocore.serialize
    import botocore.session

    model = botocore.session.get_session().get_service_model("cloudwatch")
    operation = model.operation_model("PutMetricData")
    request = botocore.serialize.create_serializer("query").serialize_to_request(
        {"Namespace": namespace, "MetricData": batch}, operation
    )
    return len(urlencode(request["body"]))


def test_cloudwatch_size_estimate_matches_botocore_query_serializer() -> None:
    m = Metrics()
    for i in range(200):
        m.observe(
            "UserRecordsPerPutRecordsRequest",
            "my-stream",
            f"shardId-{i:012d}",
            None,
            7,
            1234.5678,
            0.001234,
            99999.123,
        )
        m.add("ErrorsByCode", 3, "strange stream/ü", f"shardId-{i:012d}", "Throttled: x&y")
    values = to_values(with_ancestors(m.cumulative()), 1.0)
    data = [cloudwatch_datum(v, datetime.now(timezone.utc)) for v in values]
    namespace = "My/Name space"
    for max_datums in (20, 1000):
        batches = cloudwatch_batches(data, max_datums, namespace=namespace)
        assert sum(len(b) for b in batches) == len(data)
        for batch in batches:
            actual = _query_body_size(namespace, batch)
            assert actual <= CLOUDWATCH_MAX_PAYLOAD
            # exact but for the timestamps, counted at their longest
            assert actual <= _estimate(batch, namespace) <= actual + 10 * len(batch)
    assert len(cloudwatch_batches(data, 1000, namespace=namespace)) > 1  # the 38 KiB cap


def _estimate(batch: list[Any], namespace: str) -> int:
    return request_size(namespace) + sum(
        estimated_size(datum, index) for index, datum in enumerate(batch, 1)
    )


@pytest.mark.anyio
async def test_cloudwatch_stops_an_upload_after_a_connection_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from botocore.exceptions import EndpointConnectionError

    class Unreachable:
        calls = 0

        async def put_metric_data(self, **kwargs: Any) -> None:
            self.calls += 1
            raise EndpointConnectionError(endpoint_url="http://127.0.0.1:9")

    m = Metrics()
    for i in range(59):
        m.add("UserRecordsPut", 1, "s", f"shardId-{i:012d}", None)
    values = to_values(with_ancestors(m.cumulative()), 1.0)  # 61 data: 4 calls of 20
    sink = CloudWatchSink()
    client = sink._client = Unreachable()
    with caplog.at_level(logging.WARNING, logger="anykpl.metrics"):
        await sink.publish(MetricsReport(datetime.now(timezone.utc), 1.0, values, values))
    assert client.calls == 1
    assert (sink.failures, sink.data_dropped, sink.calls) == (1, 61, 0)
    assert len(caplog.records) == 1
    assert "61 metric data" in caplog.text
