"""The emulator over HTTP, driven by plain aiobotocore clients (asyncio and trio) and by its
control endpoint: shard limits, routing after a split, each fault kind, S3 on the same port,
and the options reaching a spawned process."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from botocore.exceptions import ClientError

from anykpl import Producer
from anykpl._core._limits import MAX_HASH_KEY, PUT_RECORDS_MAX_BYTES, PUT_RECORDS_MAX_RECORDS
from anykpl.emulator import (
    Emulator,
    EmulatorClient,
    EmulatorControlError,
    Faults,
    HttpLimits,
    Limits,
    Storm,
    spawn,
)
from anykpl.emulator._options import LARGEST_PUT_RECORDS_BODY

from .conftest import CREDENTIALS, REGION

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def emulator() -> Iterator[tuple[str, EmulatorClient]]:
    with Emulator() as url:
        yield url, EmulatorClient(url)


@pytest.fixture
def control(emulator: tuple[str, EmulatorClient]) -> Iterator[EmulatorClient]:
    client = emulator[1]
    yield client
    client.clear_faults()
    client.set_limits(enabled=True, records_per_second=1000, bytes_per_second=1024 * 1024)


@asynccontextmanager
async def kinesis(url: str) -> AsyncIterator[Any]:
    """A plain aiobotocore Kinesis client for the running backend, SDK retries off."""
    import sniffio
    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session

    options: dict[str, Any] = {"retries": {"max_attempts": 0}, "connect_timeout": 5}
    if sniffio.current_async_library() == "trio":
        from aiobotocore.httpxsession import HttpxSession

        options["http_session_cls"] = HttpxSession
    async with get_session().create_client(
        "kinesis",
        region_name=REGION,
        endpoint_url=url,
        config=AioConfig(**options),
        **CREDENTIALS,
    ) as client:
        yield client


def new_stream(control: EmulatorClient, shards: int = 1) -> str:
    name = f"emu-{uuid.uuid4().hex[:10]}"
    control.create_stream(name, shards)
    return name


def records(count: int, key: str = "hot", size: int = 20) -> list[dict[str, Any]]:
    return [{"Data": b"x" * size, "PartitionKey": key} for _ in range(count)]


async def test_three_times_the_record_limit_throttles_about_two_thirds(
    emulator: tuple[str, EmulatorClient], control: EmulatorClient
) -> None:
    stream = new_stream(control)
    async with kinesis(emulator[0]) as client:
        # drain the shard's one-second burst first, so what follows is the steady state
        for _ in range(2):
            await client.put_records(StreamName=stream, Records=records(500))
        throttled = sent = 0
        start = anyio.current_time()
        for i in range(12):  # 500 records every 1/6 s: 3,000 records/s for 2 s
            await anyio.sleep_until(start + i / 6)
            response = await client.put_records(StreamName=stream, Records=records(500))
            sent += 500
            for entry in response["Records"]:
                if entry.get("ErrorCode") == "ProvisionedThroughputExceededException":
                    throttled += 1
                    assert entry["ErrorMessage"].startswith("Rate exceeded for shard ")
                else:
                    assert "SequenceNumber" in entry
            assert response["FailedRecordCount"] == sum(
                1 for e in response["Records"] if "ErrorCode" in e
            )
    assert 0.55 <= throttled / sent <= 0.75, throttled / sent


async def test_new_records_go_to_the_children_after_a_split(
    emulator: tuple[str, EmulatorClient], control: EmulatorClient
) -> None:
    stream = new_stream(control)
    ends = [
        {"Data": b"a", "PartitionKey": "a", "ExplicitHashKey": str(k)} for k in (0, MAX_HASH_KEY)
    ]
    async with kinesis(emulator[0]) as client:
        before = await client.put_records(StreamName=stream, Records=ends)
        assert {r["ShardId"] for r in before["Records"]} == {"shardId-000000000000"}
        control.reshard(stream, "split")
        with anyio.fail_after(5):
            while not control.stats()["reshards"]:  # noqa: ASYNC110 (polling another thread)
                await anyio.sleep(0.02)
        assert control.stats()["reshards"][-1]["result"] == "ok"
        after = await client.put_records(StreamName=stream, Records=ends)
        assert [r["ShardId"] for r in after["Records"]] == [
            "shardId-000000000001",
            "shardId-000000000002",
        ]
        shards = {s["ShardId"]: s for s in (await client.list_shards(StreamName=stream))["Shards"]}
        assert "EndingSequenceNumber" in shards["shardId-000000000000"]["SequenceNumberRange"]
        assert shards["shardId-000000000001"]["ParentShardId"] == "shardId-000000000000"
        iterator = (
            await client.get_shard_iterator(
                StreamName=stream, ShardId="shardId-000000000000", ShardIteratorType="TRIM_HORIZON"
            )
        )["ShardIterator"]
        parent_records = (await client.get_records(ShardIterator=iterator))["Records"]
        assert len(parent_records) == 2


async def test_scheduled_scale_happens_at_its_time(
    emulator: tuple[str, EmulatorClient], control: EmulatorClient
) -> None:
    stream = new_stream(control, 2)
    control.reshard(stream, "scale", target=4, at=1.0)
    assert sum(1 for s in control.stats()["shards"] if s["stream"] == stream and s["open"]) == 2
    async with kinesis(emulator[0]) as client:

        async def open_shards() -> int:
            shards = (await client.list_shards(StreamName=stream))["Shards"]
            return sum(1 for s in shards if "EndingSequenceNumber" not in s["SequenceNumberRange"])

        with anyio.fail_after(5):
            while await open_shards() != 4:  # noqa: ASYNC110 (polling the server)
                await anyio.sleep(0.05)


async def test_whole_request_errors_are_500_or_503(
    emulator: tuple[str, EmulatorClient], control: EmulatorClient
) -> None:
    stream = new_stream(control)
    control.set_faults(error_rate=1.0, fault_after_write=0.0, seed=7)
    statuses = set()
    async with kinesis(emulator[0]) as client:
        for _ in range(12):
            with pytest.raises(ClientError) as caught:
                await client.put_records(StreamName=stream, Records=records(1))
            statuses.add(caught.value.response["ResponseMetadata"]["HTTPStatusCode"])
            assert caught.value.response["Error"]["Code"] in (
                "InternalFailure",
                "ServiceUnavailable",
            )
    assert statuses == {500, 503}
    stats = control.stats()
    assert stats["totals"]["request_errors"] >= 12
    assert all(s["accepted_records"] == 0 for s in stats["shards"] if s["stream"] == stream)


async def test_an_error_after_the_write_keeps_the_records(
    emulator: tuple[str, EmulatorClient], control: EmulatorClient
) -> None:
    stream = new_stream(control)
    control.set_faults(error_rate=1.0, fault_after_write=1.0)
    async with kinesis(emulator[0]) as client:
        with pytest.raises(ClientError):
            await client.put_records(StreamName=stream, Records=records(3))
    shard = next(s for s in control.stats()["shards"] if s["stream"] == stream)
    assert shard["accepted_records"] == 3


async def test_per_record_internal_failures(
    emulator: tuple[str, EmulatorClient], control: EmulatorClient
) -> None:
    stream = new_stream(control)
    control.set_faults(record_failure_rate=1.0)
    async with kinesis(emulator[0]) as client:
        response = await client.put_records(StreamName=stream, Records=records(4))
    assert response["FailedRecordCount"] == 4
    assert {r["ErrorCode"] for r in response["Records"]} == {"InternalFailure"}


async def test_per_record_throttles_whatever_the_rate(
    emulator: tuple[str, EmulatorClient], control: EmulatorClient
) -> None:
    stream = new_stream(control)
    assert control.set_faults(record_throttle_rate=1.0)["record_throttle_rate"] == 1.0
    assert control.faults()["error_rate"] == 0.0  # the other fields kept
    async with kinesis(emulator[0]) as client:
        response = await client.put_records(StreamName=stream, Records=records(4))
        assert response["FailedRecordCount"] == 4
        assert {r["ErrorCode"] for r in response["Records"]} == {
            "ProvisionedThroughputExceededException"
        }
        assert response["Records"][0]["ErrorMessage"].startswith("Rate exceeded for shard ")
        with pytest.raises(ClientError) as caught:
            await client.put_record(StreamName=stream, Data=b"x", PartitionKey="k")
        assert caught.value.response["Error"]["Code"] == "ProvisionedThroughputExceededException"
        control.set_faults(record_throttle_rate=0.0)
        response = await client.put_records(StreamName=stream, Records=records(4))
        assert response["FailedRecordCount"] == 0
    shard = next(s for s in control.stats()["shards"] if s["stream"] == stream)
    assert shard["throttled_records"] == shard["injected_throttled_records"] == 5
    assert shard["accepted_records"] == 4
    with pytest.raises(EmulatorControlError):
        control.set_faults(record_throttle_rate=1.5)


async def test_connection_resets(
    emulator: tuple[str, EmulatorClient], control: EmulatorClient
) -> None:
    from botocore.exceptions import ConnectionError as BotocoreConnectionError
    from botocore.exceptions import HTTPClientError

    stream = new_stream(control)
    control.set_faults(reset_rate=1.0)
    async with kinesis(emulator[0]) as client:
        with pytest.raises((BotocoreConnectionError, HTTPClientError)):
            await client.put_records(StreamName=stream, Records=records(1))
        control.clear_faults()
        response = await client.put_records(StreamName=stream, Records=records(1))
        assert response["FailedRecordCount"] == 0
    assert control.stats()["totals"]["resets"] >= 1


async def test_added_latency(emulator: tuple[str, EmulatorClient], control: EmulatorClient) -> None:
    stream = new_stream(control)
    async with kinesis(emulator[0]) as client:
        await client.put_records(StreamName=stream, Records=records(1))  # connect first
        control.set_faults(latency=0.3)
        started = anyio.current_time()
        await client.put_records(StreamName=stream, Records=records(1))
        assert anyio.current_time() - started >= 0.3


async def test_a_throttle_storm_cuts_the_shard_then_ends(
    emulator: tuple[str, EmulatorClient], control: EmulatorClient
) -> None:
    stream = new_stream(control)
    async with kinesis(emulator[0]) as client:
        # (the storm starts once the client is open: opening it took longer than the storm's
        # 0.6 s on a loaded machine, and the storm was over before the first request)
        control.storm(stream, duration=1.5, factor=0.0)
        started = anyio.current_time()
        response = await client.put_records(StreamName=stream, Records=records(5))
        assert response["FailedRecordCount"] == 5
        shard = next(s for s in control.stats()["shards"] if s["stream"] == stream)
        assert shard["limit_records"] == 0
        await anyio.sleep_until(started + 1.7)
        response = await client.put_records(StreamName=stream, Records=records(5))
        assert response["FailedRecordCount"] == 0


async def test_limits_can_be_turned_off_at_run_time(
    emulator: tuple[str, EmulatorClient], control: EmulatorClient
) -> None:
    stream = new_stream(control)
    control.set_limits(enabled=False)
    async with kinesis(emulator[0]) as client:
        for _ in range(6):
            response = await client.put_records(StreamName=stream, Records=records(500))
            assert response["FailedRecordCount"] == 0


async def test_missing_stream_is_resource_not_found(
    emulator: tuple[str, EmulatorClient], control: EmulatorClient
) -> None:
    async with kinesis(emulator[0]) as client:
        with pytest.raises(ClientError) as caught:
            await client.put_records(StreamName="no-such-stream", Records=records(1))
    assert caught.value.response["Error"]["Code"] == "ResourceNotFoundException"


def test_control_endpoint_rejects_bad_values_clearly(control: EmulatorClient) -> None:
    with pytest.raises(EmulatorControlError, match="error_rate"):
        control.set_faults(error_rate=2)
    with pytest.raises(EmulatorControlError, match="unknown Faults field"):
        control.set_faults(eror_rate=0.1)
    assert control.faults()["error_rate"] == 0.0


def test_s3_is_served_on_the_same_port(emulator: tuple[str, EmulatorClient]) -> None:
    import boto3

    s3 = boto3.client("s3", region_name=REGION, endpoint_url=emulator[0], **CREDENTIALS)
    bucket = f"bucket-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=bucket)
    s3.put_object(Bucket=bucket, Key="lease", Body=b"one", IfNoneMatch="*")
    with pytest.raises(ClientError) as caught:
        s3.put_object(Bucket=bucket, Key="lease", Body=b"two", IfNoneMatch="*")
    assert caught.value.response["Error"]["Code"] == "PreconditionFailed"
    assert s3.get_object(Bucket=bucket, Key="lease")["Body"].read() == b"one"


def test_spawned_process_gets_every_option() -> None:
    with spawn(
        streams={"opts": 3},
        limits=Limits(records_per_second=50, bytes_per_second=5000),
        faults=Faults(error_rate=0.25, record_throttle_rate=0.125, latency=0.01, seed=4),
        storms=[Storm("opts", duration=60, start=30, factor=0.5)],
        http=HttpLimits(max_body_bytes=10_000_000, read_timeout=7.5),
    ) as url:
        stats = EmulatorClient(url).stats()
    assert stats["http"] == {"max_body_bytes": 10_000_000, "read_timeout": 7.5}
    assert stats["limits"] == {"enabled": True, "records_per_second": 50, "bytes_per_second": 5000}
    assert stats["faults"]["error_rate"] == 0.25
    assert stats["faults"]["record_throttle_rate"] == 0.125
    assert stats["faults"]["seed"] == 4
    assert [s["stream"] for s in stats["storms"]] == ["opts"]
    assert sorted(s["shard_id"] for s in stats["shards"]) == [
        f"shardId-00000000000{i}" for i in range(3)
    ]


async def test_async_context_manager_serves(anyio_backend: str) -> None:
    # moto's backends are per process: a second in-process emulator sees the same streams
    name = f"own-{uuid.uuid4().hex[:8]}"
    async with Emulator(streams={name: 1}, limits=Limits.off()) as url, kinesis(url) as client:
        response = await client.put_records(StreamName=name, Records=records(3))
    assert response["FailedRecordCount"] == 0


async def test_a_merge_sends_new_records_to_the_child_and_keeps_the_parents_records(
    emulator: tuple[str, EmulatorClient], control: EmulatorClient
) -> None:
    stream = new_stream(control, 2)
    ends = [
        {"Data": b"m", "PartitionKey": "m", "ExplicitHashKey": str(k)} for k in (0, MAX_HASH_KEY)
    ]
    async with kinesis(emulator[0]) as client:
        await client.put_records(StreamName=stream, Records=ends)
        control.reshard(stream, "merge", shard_id="shardId-000000000001")
        with anyio.fail_after(5):
            while not any(  # noqa: ASYNC110 (polling another thread)
                r["stream"] == stream for r in control.stats()["reshards"]
            ):
                await anyio.sleep(0.02)
        after = await client.put_records(StreamName=stream, Records=ends)
        assert {r["ShardId"] for r in after["Records"]} == {"shardId-000000000002"}
        total = 0
        for shard in (await client.list_shards(StreamName=stream))["Shards"]:
            iterator = (
                await client.get_shard_iterator(
                    StreamName=stream, ShardId=shard["ShardId"], ShardIteratorType="TRIM_HORIZON"
                )
            )["ShardIterator"]
            total += len((await client.get_records(ShardIterator=iterator))["Records"])
        assert total == 4  # two in the parents, two in the child, none copied


# -- the HTTP edge and control mistakes ------------------------------------------------------


def raw_exchange(url: str, payload: bytes) -> bytes:
    """Send raw bytes, return everything the server answers until it closes or goes quiet."""
    import socket
    import urllib.parse

    address = urllib.parse.urlsplit(url)
    with socket.create_connection((address.hostname, address.port), timeout=2) as sock:
        sock.sendall(payload)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except TimeoutError:
            pass
    return received


def test_malformed_requests_get_a_400_and_the_server_keeps_serving(
    emulator: tuple[str, EmulatorClient], control: EmulatorClient
) -> None:
    assert raw_exchange(emulator[0], b"GARBAGE\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    bad_length = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n"
    assert raw_exchange(emulator[0], bad_length).startswith(b"HTTP/1.1 400 ")
    assert control.health()["ok"]


def test_pipelined_chunked_and_connection_close_requests(
    emulator: tuple[str, EmulatorClient],
) -> None:
    chunked = (
        b"POST /_anykpl/faults HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Expect: 100-continue\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    )
    closing = b"GET /_anykpl/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    answer = raw_exchange(emulator[0], chunked + closing)
    assert answer.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK")
    assert answer.count(b"HTTP/1.1 200 OK") == 2
    assert b"Connection: close" in answer


def test_a_deleted_stream_is_not_written_and_a_recreated_one_starts_empty(
    emulator: tuple[str, EmulatorClient], control: EmulatorClient
) -> None:
    import boto3

    client = boto3.client("kinesis", region_name=REGION, endpoint_url=emulator[0], **CREDENTIALS)
    stream = new_stream(control)
    client.put_record(StreamName=stream, Data=b"old", PartitionKey="k")
    client.delete_stream(StreamName=stream)
    with pytest.raises(ClientError) as caught:
        client.put_record(StreamName=stream, Data=b"lost?", PartitionKey="k")
    assert caught.value.response["Error"]["Code"] == "ResourceNotFoundException"
    client.create_stream(StreamName=stream, ShardCount=1)
    put = client.put_record(StreamName=stream, Data=b"new", PartitionKey="k")
    iterator = client.get_shard_iterator(
        StreamName=stream,
        ShardId=put["ShardId"],
        ShardIteratorType="AT_SEQUENCE_NUMBER",
        StartingSequenceNumber=put["SequenceNumber"],
    )["ShardIterator"]
    assert [r["Data"] for r in client.get_records(ShardIterator=iterator)["Records"]] == [b"new"]


def test_put_record_by_stream_arn_and_bad_hash_keys(
    emulator: tuple[str, EmulatorClient], control: EmulatorClient
) -> None:
    import boto3

    client = boto3.client("kinesis", region_name=REGION, endpoint_url=emulator[0], **CREDENTIALS)
    stream = new_stream(control)
    arn = client.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"]["StreamARN"]
    assert client.put_record(StreamARN=arn, Data=b"a", PartitionKey="k")["SequenceNumber"] == "1"
    with pytest.raises(ClientError) as caught:
        client.put_record(StreamName=stream, Data=b"a", PartitionKey="k", ExplicitHashKey="²")
    assert caught.value.response["Error"]["Code"] == "InvalidArgumentException"
    # more digits than Python's int() converts (4,300) is the service's 400, not a 500
    huge = "9" * 5000
    for put in (
        lambda: client.put_record(
            StreamName=stream, Data=b"a", PartitionKey="k", ExplicitHashKey=huge
        ),
        lambda: client.put_records(
            StreamName=stream,
            Records=[{"Data": b"a", "PartitionKey": "k", "ExplicitHashKey": huge}],
        ),
    ):
        with pytest.raises(ClientError) as caught:
            put()
        assert caught.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400
        assert caught.value.response["Error"]["Code"] == "InvalidArgumentException"


def test_s3_head_object_reports_the_object_length(emulator: tuple[str, EmulatorClient]) -> None:
    import boto3

    s3 = boto3.client("s3", region_name=REGION, endpoint_url=emulator[0], **CREDENTIALS)
    bucket = f"bucket-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=bucket)
    s3.put_object(Bucket=bucket, Key="k", Body=b"eleven byte")
    assert s3.head_object(Bucket=bucket, Key="k")["ContentLength"] == 11


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c, s: c.reshard("no-such-stream", "split"), "no stream"),
        (lambda c, s: c.reshard(s, "split", shard_id="shardId-000000000042"), "no open shard"),
        (lambda c, s: c.reshard(s, "merge"), "nothing to merge"),
        (lambda c, s: c.reshard(s, "scale", target=4), "half to double"),
        (lambda c, s: c.storm("no-such-stream", duration=1), "no stream"),
        (lambda c, s: c.storm(s, duration=1, shard_id="shardId-000000000042"), "no shard"),
        (lambda c, s: c.create_stream(s), "already exists"),
    ],
)
def test_control_mistakes_are_refused_at_once_with_the_reason(
    control: EmulatorClient, call: Any, message: str
) -> None:
    stream = new_stream(control)  # one shard
    with pytest.raises(EmulatorControlError, match=message):
        call(control, stream)


def test_a_second_in_process_emulator_names_the_shared_stream() -> None:
    name = f"shared-{uuid.uuid4().hex[:8]}"
    with Emulator(streams={name: 1}), pytest.raises(RuntimeError) as caught:
        Emulator(streams={name: 1}).start()
    assert "already exists" in str(caught.value.__cause__)


# -- ListShards pages ------------------------------------------------------------------------


async def test_list_shards_pages_like_the_service(
    emulator: tuple[str, EmulatorClient], control: EmulatorClient
) -> None:
    stream = new_stream(control, 1200)
    async with kinesis(emulator[0]) as client:
        first = await client.list_shards(StreamName=stream)
        assert len(first["Shards"]) == 1000
        # later pages carry the token alone: it names the stream
        second = await client.list_shards(NextToken=first["NextToken"], MaxResults=10000)
        assert "NextToken" not in second
        listed = [s["ShardId"] for s in first["Shards"] + second["Shards"]]
        assert listed == [f"shardId-{i:012d}" for i in range(1200)]
        with pytest.raises(ClientError) as caught:
            await client.list_shards(NextToken=first["NextToken"], StreamName=stream)
        assert caught.value.response["Error"] == {
            "Code": "InvalidArgumentException",
            "Message": "NextToken and StreamName cannot be provided together.",
        }
        with pytest.raises(ClientError) as caught:
            await client.list_shards(NextToken="not-a-token")
        assert caught.value.response["Error"]["Code"] == "InvalidArgumentException"


async def test_the_producer_maps_a_stream_of_more_than_a_thousand_shards(
    emulator: tuple[str, EmulatorClient], control: EmulatorClient
) -> None:
    stream = new_stream(control, 1200)
    async with Producer(region=REGION, endpoint_url=emulator[0], **CREDENTIALS) as producer:
        await producer.put_record(stream, b"x", partition_key="k")
        with anyio.fail_after(10):
            while producer.statistics().streams[stream].shard_map_state != "READY":  # noqa: ASYNC110
                await anyio.sleep(0.01)
        open_shards = producer.statistics().streams[stream].open_shards
    assert sorted(open_shards) == [f"shardId-{i:012d}" for i in range(1200)]


# -- HTTP hardening ----------------------------------------------------------------------------


def exchange_until_close(url: str, payload: bytes, timeout: float = 5.0) -> bytes:
    """Send raw bytes; return the whole answer, which must end with the server closing."""
    import socket
    import urllib.parse

    address = urllib.parse.urlsplit(url)
    with socket.create_connection((address.hostname, address.port), timeout=timeout) as sock:
        sock.sendall(payload)
        received = b""
        while chunk := sock.recv(65536):  # a TimeoutError here: the server kept it open
            received += chunk
    return received


def unhandled(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


HEAD = b"POST / HTTP/1.1\r\nHost: x\r\nX-Amz-Target: Kinesis_20131202.PutRecords\r\n"


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (HEAD + b"Content-Length: -5\r\n\r\n", 400),
        (HEAD + b"Content-Length: +5\r\n\r\n{}", 400),
        (HEAD + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400),
        (HEAD + b"Content-Length: " + b"9" * 20 + b"\r\n\r\n", 413),
        # h11 refuses a length of more than 20 digits as malformed
        (HEAD + b"Content-Length: " + b"9" * 21 + b"\r\n\r\n", 400),
        (HEAD + b"Content-Length: " + b"9" * 5000 + b"\r\n\r\n", 400),
        (HEAD + b"Content-Length: %d\r\n\r\n" % (32 * 1024 * 1024 + 1), 413),
        (HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
        (HEAD + b"Transfer-Encoding: chunked\r\n\r\n-5\r\n", 400),
        (HEAD + b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}XX0\r\n\r\n", 400),
        (HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + b"f" * 21 + b"\r\n", 400),
        (HEAD + b"Transfer-Encoding: gzip\r\n\r\n", 501),
        (HEAD + b"X-Long: " + b"x" * (2 << 20), 431),  # no end in sight past 1 MiB
        (b"POST / HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 400),
    ],
    ids=[
        "negative-length",
        "signed-length",
        "two-lengths",
        "huge-length",
        "21-digit-length",
        "5000-digit-length",
        "over-the-cap",
        "bad-chunk-size",
        "negative-chunk-size",
        "no-crlf-after-chunk",
        "21-digit-chunk-size",
        "unknown-coding",
        "head-over-1-mib",
        "no-host",
    ],
)
def test_bad_framing_is_answered_then_the_connection_closed(
    emulator: tuple[str, EmulatorClient],
    control: EmulatorClient,
    caplog: pytest.LogCaptureFixture,
    request_bytes: bytes,
    status: int,
) -> None:
    answer = exchange_until_close(emulator[0], request_bytes)
    assert answer.startswith(b"HTTP/1.1 %d " % status), answer[:200]
    assert b"Connection: close" in answer
    assert control.health()["ok"]  # served after the connection's task has ended
    assert unhandled(caplog) == []


def test_a_body_over_the_cap_is_refused_while_the_client_sends_it() -> None:
    # the smallest cap allowed: the largest valid PutRecords request still fits
    limits = HttpLimits(max_body_bytes=LARGEST_PUT_RECORDS_BODY)
    name = f"cap-{uuid.uuid4().hex[:8]}"
    with Emulator(streams={name: 1}, limits=Limits.off(), http=limits) as url:
        import boto3

        client = boto3.client("kinesis", region_name=REGION, endpoint_url=url, **CREDENTIALS)
        key = "é" * 256  # 256 characters, 512 bytes, sent as 1,536 bytes of \\u escapes
        size = PUT_RECORDS_MAX_BYTES // PUT_RECORDS_MAX_RECORDS - len(key.encode())
        largest = [
            {"Data": b"x" * size, "PartitionKey": key, "ExplicitHashKey": str(MAX_HASH_KEY)}
            for _ in range(PUT_RECORDS_MAX_RECORDS)
        ]
        assert client.put_records(StreamName=name, Records=largest)["FailedRecordCount"] == 0
        body = b"x" * (LARGEST_PUT_RECORDS_BODY + 1)
        answer = exchange_until_close(url, HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        # a chunked body is measured as its data arrives (h11 does not tell its declared size)
        chunked = HEAD + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % len(body) + body
        chunked_answer = exchange_until_close(url, chunked)
    for refusal in (answer, chunked_answer):
        assert refusal.startswith(b"HTTP/1.1 413 ")
        assert b"HttpLimits.max_body_bytes" in refusal


def test_idle_and_half_open_connections_are_closed_and_do_not_starve_clients(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import socket
    import time
    import urllib.parse

    import boto3

    # the server runs on its own thread and real clock: no mock clock reaches it, so the read
    # timeout is short and every wait below ends on the server's action, bounded by a timeout
    name = f"idle-{uuid.uuid4().hex[:8]}"
    with Emulator(streams={name: 1}, http=HttpLimits(read_timeout=0.5)) as url:
        address = urllib.parse.urlsplit(url)
        idle, stalled = [], []
        for i in range(300):
            sock = socket.create_connection((address.hostname, address.port), timeout=5)
            if i % 2:  # a head that promises a body that never comes
                sock.sendall(HEAD + b"Content-Length: 100\r\n\r\n{")
                stalled.append(sock)
            else:
                idle.append(sock)
        started = time.monotonic()
        client = boto3.client("kinesis", region_name=REGION, endpoint_url=url, **CREDENTIALS)
        assert client.put_record(StreamName=name, Data=b"a", PartitionKey="k")["SequenceNumber"]
        assert time.monotonic() - started < 2.0
        try:
            for sock in idle:
                assert sock.recv(65536) == b""  # closed, not left open
            for sock in stalled:
                answer = b""
                while chunk := sock.recv(65536):
                    answer += chunk
                assert answer.startswith(b"HTTP/1.1 408 Request Timeout"), answer[:100]
        finally:
            for sock in idle + stalled:
                sock.close()
        # a keep-alive client that waits past the timeout simply reconnects
        time.sleep(0.6)  # the real clock: the server is on its own thread
        assert client.put_record(StreamName=name, Data=b"b", PartitionKey="k")["SequenceNumber"]
    assert unhandled(caplog) == []
