"""Stream ARNs wherever a stream name goes (cross-account access, as in the KPL 0.15.9): the
requests name the stream by ``StreamARN``."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from anykpl import Producer, errors

from .conftest import CREDENTIALS, REGION
from .test_end_to_end import check_read_back, make_sent, read_stream_async
from .test_sdk_attempts import _endpoint, _Stub, stub  # noqa: F401 (the fixture)

pytestmark = pytest.mark.anyio

ARN = "arn:aws:kinesis:us-east-1:123456789012:stream/stub-stream"


async def test_an_arn_is_sent_as_stream_arn(stub: _Stub) -> None:  # noqa: F811
    stub.fail_first = False
    options = {"region": REGION, "endpoint_url": _endpoint(stub), **CREDENTIALS}
    async with Producer(**options) as producer:
        result = await producer.put_record(ARN, b"payload", partition_key="key")
    assert result.success
    operations = {operation for operation, _ in stub.bodies}
    assert operations == {"ListShards", "PutRecords"}
    for operation, body in stub.bodies:
        if "NextToken" not in body:
            assert body.get("StreamARN") == ARN, (operation, body)
            assert "StreamName" not in body, (operation, body)


async def test_records_put_by_arn_are_in_the_stream(
    make_stream: Any, kinesis_client: Any, producer_options: dict[str, Any]
) -> None:
    stream = make_stream(2)
    arn = kinesis_client.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"][
        "StreamARN"
    ]
    sent = {uid: make_sent(uid, f"key-{uid}") for uid in range(200)}
    async with Producer(**producer_options) as producer:
        handles = [await producer.submit(arn, s.data, s.partition_key) for s in sent.values()]
        await producer.flush()
        results = [await handle for handle in handles]
        assert producer.statistics().streams[arn].shard_map_state == "READY"
    assert all(result.success for result in results)
    contents = await read_stream_async(kinesis_client, stream)
    assert check_read_back(contents, sent) == Counter(set(sent))


@pytest.mark.parametrize(
    "stream",
    [
        "arn:aws:kinesis:us-east-1:123:stream/s",  # account of 3 digits
        "arn:aws:s3:::bucket",
        "arn:aws:kinesis:us-east-1:123456789012:stream/",
        "arn:aws:kinesis:us-east-1:123456789012:stream/" + "s" * 129,
        "arn:" + "x" * 5000,
    ],
)
async def test_a_bad_arn_is_refused_at_the_call(stream: str) -> None:
    async with Producer(region=REGION, **CREDENTIALS, endpoint_url="http://127.0.0.1:9") as p:
        with pytest.raises(errors.InvalidRecordError, match="invalid stream ARN") as caught:
            await p.submit(stream, b"x", "k")
    assert len(str(caught.value)) < 400
