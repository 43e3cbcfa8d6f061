"""Records up to 10 MiB, as the service takes them on a stream whose maximum record size was
raised (``MaxRecordSizeInKiB``), against the emulator with the service's shard limits, on both
backends; every record read back from the stream."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import anyio
import boto3
import pytest

from anykpl import Producer
from anykpl.emulator import spawn
from anykpl.errors import RecordFailedError

from .conftest import CREDENTIALS, REGION
from .test_end_to_end import assert_success, check_read_back, make_sent, read_stream

pytestmark = pytest.mark.anyio

MiB = 1024 * 1024


def _client(url: str) -> Any:
    return boto3.client("kinesis", region_name=REGION, endpoint_url=url, **CREDENTIALS)


@pytest.mark.timeout(90)
async def test_records_up_to_the_streams_raised_maximum_are_delivered() -> None:
    stream = f"large-{random.randrange(1 << 32):08x}"
    with spawn() as url:
        client = _client(url)
        client.create_stream(StreamName=stream, ShardCount=1, MaxRecordSizeInKiB=10240)
        summary = client.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"]
        assert summary["MaxRecordSizeInKiB"] == 10240
        # small ones, and one near the 10 MiB maximum: more than a 5 MiB request, so it goes
        # alone (10 MiB requests here), and ten times the shard's 1 MiB/s, which the shard
        # (and the producer's limiter) take by bursting into debt
        sent = {uid: make_sent(uid, f"k{uid}", size=2000) for uid in range(20)}
        sent[100] = make_sent(100, "big", size=10 * MiB - 100)
        async with Producer(
            region=REGION, endpoint_url=url, max_user_record_size=10 * MiB, **CREDENTIALS
        ) as producer:
            handles = [
                await producer.submit(stream, record.data, record.partition_key)
                for record in sent.values()
            ]
            for handle in handles:
                assert_success(await handle)
        contents = await anyio.to_thread.run_sync(read_stream, client, stream)
    assert check_read_back(contents, sent) == Counter(set(sent))


@pytest.mark.timeout(60)
async def test_a_record_over_the_streams_maximum_fails_until_the_maximum_is_raised() -> None:
    stream = f"large-{random.randrange(1 << 32):08x}"
    record = make_sent(1, "k", size=2 * MiB)
    with spawn(streams={stream: 1}) as url:
        client = _client(url)
        summary = client.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"]
        assert summary["MaxRecordSizeInKiB"] == 1024  # every stream's, unless raised
        async with Producer(
            region=REGION, endpoint_url=url, max_user_record_size=10 * MiB, **CREDENTIALS
        ) as producer:
            with pytest.raises(RecordFailedError, match=r"ValidationException.*1048576"):
                await producer.put_record(stream, record.data, record.partition_key)
            arn = summary["StreamARN"]
            client.update_max_record_size(StreamARN=arn, MaxRecordSizeInKiB=4096)
            assert_success(await producer.put_record(stream, record.data, record.partition_key))
        contents = await anyio.to_thread.run_sync(read_stream, client, stream)
    assert check_read_back(contents, {1: record}) == Counter({1: 1})
