"""Each metrics sink against a real endpoint: CloudWatch on moto's server (read back with
ListMetrics and GetMetricStatistics), Prometheus scraped over HTTP, OpenTelemetry through the
SDK's in-memory reader."""

from __future__ import annotations

import urllib.request
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import anyio
import pytest

from anykpl import Producer
from anykpl.metrics import CloudWatchSink, OpenTelemetrySink, PrometheusSink

from .conftest import CREDENTIALS, REGION

pytestmark = pytest.mark.anyio

FAST = {"record_max_buffered_time": 0.01, "metrics_upload_delay": 0.2}
#: an upload delay a CloudWatch publish (one or more PutMetricData calls, 0.1-0.2 s on a busy
#: 2-core VM) fits in: a publish longer than the delay is cut off, its report lost for the sink
ROOMY = {**FAST, "metrics_upload_delay": 1.0}


async def _put(producer: Producer, stream: str, count: int) -> None:
    for i in range(count):
        await producer.put_record(stream, b"reading", partition_key=f"device-{i}")


async def test_cloudwatch_statistic_sets_read_back(
    moto_endpoint: str, make_stream: Any, producer_options: dict[str, Any]
) -> None:
    import boto3

    stream = make_stream(2)
    namespace = f"anykpl-test-{uuid.uuid4().hex[:8]}"
    sink = CloudWatchSink(namespace=namespace, endpoint_url=moto_endpoint)
    async with Producer(metrics_sinks=[sink], **producer_options, **ROOMY) as producer:
        await _put(producer, stream, 20)
        await anyio.sleep(1.5)  # at least one periodic upload
        periodic_calls = sink.calls
        await _put(producer, stream, 5)
    assert periodic_calls >= 1
    assert sink.failures == 0
    assert sink.calls > periodic_calls  # the final upload on close

    cloudwatch = boto3.client(
        "cloudwatch", region_name=REGION, endpoint_url=moto_endpoint, **CREDENTIALS
    )
    listed = cloudwatch.list_metrics(Namespace=namespace, MetricName="UserRecordsPut")["Metrics"]
    dimension_sets = {tuple((d["Name"], d["Value"]) for d in m["Dimensions"]) for m in listed}
    assert () in dimension_sets  # global
    assert (("StreamName", stream),) in dimension_sets
    assert any(len(d) == 2 and d[1][0] == "ShardId" for d in dimension_sets)  # KPL order

    # one query per shard: moto matches every metric whose dimensions include the ones asked
    # for (CloudWatch matches them exactly), so the deepest level is the unambiguous one
    now = datetime.now(timezone.utc)
    points = []
    for dimensions in dimension_sets:
        if len(dimensions) != 2:
            continue
        points += cloudwatch.get_metric_statistics(
            Namespace=namespace,
            MetricName="UserRecordsPut",
            Dimensions=[{"Name": name, "Value": value} for name, value in dimensions],
            StartTime=now - timedelta(minutes=10),
            EndTime=now + timedelta(minutes=1),
            Period=60,
            Statistics=["Sum", "SampleCount", "Minimum", "Maximum"],
        )["Datapoints"]
    assert sum(p["Sum"] for p in points) == 25
    assert sum(p["SampleCount"] for p in points) == 25
    assert all(p["Minimum"] == 1 and p["Maximum"] == 1 for p in points)
    request_time = cloudwatch.list_metrics(Namespace=namespace, MetricName="RequestTime")
    assert request_time["Metrics"]


@pytest.mark.parametrize("given", ["keys", "profile"])
async def test_cloudwatch_with_its_own_credentials_writes_to_their_account(
    given: str,
    moto_endpoint: str,
    make_stream: Any,
    producer_options: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The KPL's MetricsCredentialsProvider: a sink with its own credentials (keys, or a
    profile) signs with those, not the producer's. moto's server keeps an account per access
    key: the metrics land in the account of the role the sink's credentials come from, and
    the producer's account has none of them."""
    import boto3

    def client(service: str, **credentials: Any) -> Any:
        return boto3.client(
            service, region_name=REGION, endpoint_url=moto_endpoint, **(credentials or CREDENTIALS)
        )

    other_account = "222222222222"
    assumed = client("sts").assume_role(
        RoleArn=f"arn:aws:iam::{other_account}:role/metrics-writer", RoleSessionName="metrics"
    )["Credentials"]
    keys = {
        "aws_access_key_id": assumed["AccessKeyId"],
        "aws_secret_access_key": assumed["SecretAccessKey"],
        "aws_session_token": assumed["SessionToken"],
    }
    namespace = f"anykpl-test-{uuid.uuid4().hex[:8]}"
    if given == "keys":
        sink = CloudWatchSink(namespace=namespace, endpoint_url=moto_endpoint, **keys)
    else:
        credentials_file = tmp_path / "credentials"
        credentials_file.write_text(
            "[metrics]\n" + "".join(f"{name} = {value}\n" for name, value in keys.items())
        )
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials_file))
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))  # none: no surprises
        sink = CloudWatchSink(namespace=namespace, endpoint_url=moto_endpoint, profile="metrics")
    assert assumed["SecretAccessKey"] not in repr(sink)
    stream = make_stream(1)
    async with Producer(metrics_sinks=[sink], **producer_options, **ROOMY) as producer:
        await _put(producer, stream, 3)
    assert sink.failures == 0
    assert sink.calls >= 1

    def names(**credentials: Any) -> set[str]:
        listed = client("cloudwatch", **credentials).list_metrics(Namespace=namespace)
        return {metric["MetricName"] for metric in listed["Metrics"]}

    assert "UserRecordsPut" in names(**keys)
    assert names() == set()  # the producer's own account


async def test_cloudwatch_failures_are_counted_not_raised(
    make_stream: Any, producer_options: dict[str, Any]
) -> None:
    stream = make_stream(1)
    # nothing listens on port 9: every PutMetricData fails
    sink = CloudWatchSink(endpoint_url="http://127.0.0.1:9")
    options = {**producer_options, **FAST, "connect_timeout": 0.2, "request_timeout": 0.5}
    async with Producer(metrics_sinks=[sink], **options) as producer:
        result = await producer.put_record(stream, b"x", partition_key="k")
        assert result.success
        uploader = producer._uploader
        assert uploader is not None
    # botocore's own retries may outlast the publish bound (metrics_upload_delay, 0.2 s here):
    # then the upload task counts the failure rather than the sink
    assert sink.failures + uploader.failures[0] >= 1
    assert sink.calls == 0


async def test_prometheus_scraped_over_http(
    make_stream: Any, producer_options: dict[str, Any]
) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    registry = prometheus_client.CollectorRegistry()
    server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        stream = make_stream(2)
        sink = PrometheusSink(registry)
        async with Producer(metrics_sinks=[sink], **producer_options, **FAST) as producer:
            await _put(producer, stream, 12)
        url = f"http://127.0.0.1:{server.server_port}/metrics"

        def scrape() -> str:
            with urllib.request.urlopen(url, timeout=5) as response:
                return str(response.read().decode())

        text = await anyio.to_thread.run_sync(scrape)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    put = samples["kpl_user_records_put_total"]
    assert sum(s.value for s in put) == 12
    assert {s.labels["stream"] for s in put} == {stream}
    assert all(s.labels["shard"].startswith("shardId-") for s in put)
    assert "kpl_request_time_seconds_bucket" in samples
    assert "kpl_request_time_max_seconds" in samples
    assert "kpl_user_records_data_put_bytes_total" in samples


async def test_opentelemetry_in_memory_reader(
    make_stream: Any, producer_options: dict[str, Any]
) -> None:
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    try:
        stream = make_stream(2)
        sink = OpenTelemetrySink(provider)
        async with Producer(metrics_sinks=[sink], **producer_options, **FAST) as producer:
            await _put(producer, stream, 7)
        data = reader.get_metrics_data()
    finally:
        provider.shutdown()
    metrics = {
        m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
    }
    put = metrics["kpl.user_records_put"]
    assert sum(p.value for p in put.data.data_points) == 7
    assert all(p.attributes["stream"] == stream for p in put.data.data_points)
    request_time = metrics["kpl.request_time"]
    assert request_time.unit == "ms"
    (point,) = request_time.data.data_points
    assert point.count >= 1
    assert point.min <= point.sum / point.count <= point.max
