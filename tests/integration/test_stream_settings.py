"""Per-stream settings (``ProducerConfig.streams``) against the emulator: each stream's
pipeline runs with its own record-level settings, read back from the streams."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest

from anykpl import Producer, StreamSettings, errors
from anykpl._core._wire import MAGIC

from .test_end_to_end import check_read_back, make_sent, read_stream_async

pytestmark = pytest.mark.anyio


async def test_each_stream_runs_with_its_own_settings(
    make_stream: Any, kinesis_client: Any, producer_options: dict[str, Any]
) -> None:
    raw, aggregated = make_stream(2), make_stream(2)
    streams = {raw: StreamSettings(aggregation_enabled=False, record_ttl=60.0)}
    sent = {uid: make_sent(uid, f"key-{uid}") for uid in range(400)}
    async with Producer(**producer_options, streams=streams) as producer:
        handles = [
            await producer.submit(raw if s.uid % 2 else aggregated, s.data, s.partition_key)
            for s in sent.values()
        ]
        await producer.flush()
        results = [await handle for handle in handles]
    assert all(result.success for result in results)
    raw_contents = await read_stream_async(kinesis_client, raw)
    aggregated_contents = await read_stream_async(kinesis_client, aggregated)
    raw_records = [r for rs in raw_contents.kinesis_records.values() for r in rs]
    aggregated_records = [r for rs in aggregated_contents.kinesis_records.values() for r in rs]
    # one Kinesis record per user record where aggregation is off for the stream ...
    assert len(raw_records) == 200
    assert not any(bytes(r["Data"][:4]) == MAGIC for r in raw_records)
    # ... aggregates where it is on (the producer's default). A record alone in its aggregate
    # goes out plain, as the KPL sends it: on a busy machine the loop of submits can outlast
    # the records' deadline (record_max_buffered_time), and the last record of a shard's
    # aggregate may be the only one in it.
    assert len(aggregated_records) < 20
    plain = [r for r in aggregated_records if bytes(r["Data"][:4]) != MAGIC]
    assert len(plain) <= 4, (len(plain), len(aggregated_records))
    assert len(aggregated_records) - len(plain) >= 2  # an aggregate on each shard at least
    assert check_read_back(raw_contents, {u: s for u, s in sent.items() if u % 2}) == Counter(
        u for u in sent if u % 2
    )
    assert check_read_back(
        aggregated_contents, {u: s for u, s in sent.items() if not u % 2}
    ) == Counter(u for u in sent if not u % 2)


async def test_a_stream_ttl_of_its_own_expires_its_records_only(
    make_stream: Any, producer_options: dict[str, Any]
) -> None:
    """A 1 s TTL for one stream, records held back by a 1 % rate limit on it and admitted
    without regard to it (``max_outstanding_time=inf``): they expire there, while the other
    stream's records (the producer's settings) are delivered."""
    short, normal = make_stream(1), make_stream(1)
    streams = {
        short: StreamSettings(
            record_ttl=1.0,
            rate_limit=1.0,
            aggregation_enabled=False,
            max_outstanding_time=math.inf,
        )
    }
    async with Producer(**producer_options, streams=streams, record_max_buffered_time=0.01) as p:
        shorts = [await p.submit(short, b"x" * 10, f"k{i}") for i in range(100)]
        normals = [await p.submit(normal, b"x" * 10, f"k{i}") for i in range(100)]
        await p.flush()
    assert all(h.result().success for h in normals)
    codes = Counter(_final_code(handle) for handle in shorts)
    # 1 % of 1,000 records/s is 10 a second: most of the 100 cannot go within 1 s
    assert codes["Expired"] >= 50
    assert set(codes) <= {"Expired", None}


def _final_code(handle: Any) -> str | None:
    try:
        return handle.result().attempts[-1].error_code  # type: ignore[no-any-return]
    except errors.RecordFailedError as exc:
        return exc.result.attempts[-1].error_code
