"""Sizes are counted in UTF-8 bytes, as the service counts them, end to end.

A partition key of 256 emoji is 256 characters but 1,024 bytes. Counted in characters, the
Collector filled requests past PutRecords' 5 MiB, and the service refused every record in them
with a non-retriable InvalidArgumentException (87 of 87 valid 60 KB records).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from anykpl import Producer
from anykpl._core import _limits

from .test_end_to_end import assert_success, check_read_back, make_sent, read_stream_async

pytestmark = pytest.mark.anyio

RECORDS = 90
SHARDS = 32
SPAN = 2**128 // SHARDS
DATA_SIZE = 57_990  # over aggregation_max_size: each goes raw, one Kinesis record per record


def emoji_key(uid: int) -> str:
    """256 characters, 1,024 UTF-8 bytes, distinct per uid."""
    digits = "".join(chr(0x1F600 + int(d)) for d in f"{uid:04d}")
    return "\N{GRINNING FACE}" * 252 + digits


@pytest.mark.parametrize("aggregation", [True, False])
async def test_multi_byte_partition_keys_fill_requests_by_bytes(
    make_stream: Any, kinesis_client: Any, producer_options: dict[str, Any], aggregation: bool
) -> None:
    key = emoji_key(0)
    assert len(key) == _limits.MAX_PARTITION_KEY_LENGTH
    assert len(key.encode()) == 1024
    # counted in characters, RECORDS of these fit in one request; in bytes they do not
    assert RECORDS * (DATA_SIZE + len(key)) < _limits.PUT_RECORDS_MAX_BYTES
    assert RECORDS * (DATA_SIZE + len(key.encode())) > _limits.PUT_RECORDS_MAX_BYTES
    # spread evenly over enough shards that none fills its share of a request (the Collector's
    # COLLECTOR_SHARD_FLUSH_BYTES) or its limiter's bucket: one request holds what its size
    # allows
    stream = make_stream(SHARDS)
    sent = {
        uid: make_sent(
            uid, emoji_key(uid), size=DATA_SIZE, explicit_hash_key=str((uid % SHARDS) * SPAN + 1)
        )
        for uid in range(RECORDS)
    }
    async with Producer(aggregation_enabled=aggregation, **producer_options) as producer:
        handles = [
            await producer.submit(stream, s.data, s.partition_key, s.explicit_hash_key)
            for s in sent.values()
        ]
        await producer.flush()
        results = [await handle for handle in handles]
    for result in results:
        assert_success(result)
    contents = await read_stream_async(kinesis_client, stream)
    assert check_read_back(contents, sent) == Counter(set(sent))
