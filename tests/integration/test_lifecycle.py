"""The producer's and its streams' lifecycle against the emulator: ``aclose()``,
``flush(stream=...)``, idle streams closed and opened again, a missing stream that fails fast
without calling ListShards for ever."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from anykpl import Producer, ProducerConfig, Transport, errors
from anykpl._transport._botocore import open_transport

pytestmark = pytest.mark.anyio


async def test_aclose_inside_the_block_closes_and_the_code_after_it_runs(
    make_stream: Any, producer_options: dict[str, Any]
) -> None:
    stream = make_stream(2)
    async with Producer(**producer_options) as producer:
        pending = [await producer.submit(stream, b"x" * 100, f"k{i}") for i in range(50)]
        await producer.aclose()
        # everything admitted before the close was delivered by its flush
        assert all(p.done() and p.result().success for p in pending)
        with pytest.raises(errors.ProducerClosedError):
            await producer.put_record(stream, b"late", "k")
        await producer.aclose()  # idempotent
        # the caller's code in the block is not cancelled by the close
        await anyio.sleep(0.01)
        reached = True
    assert reached
    assert producer.outstanding_records == 0


async def test_the_oldest_records_age_and_the_records_pending_while_records_wait(
    make_stream: Any, producer_options: dict[str, Any]
) -> None:
    """Records that wait for their buffered time (the KPL's batching) age in
    ``oldest_record_age`` (the KPL's getOldestRecordTimeInMillis), count in
    ``outstanding_records`` and in the ``UserRecordsPending`` metric, until a flush."""
    stream = make_stream(1)
    options = {
        **producer_options,
        "record_max_buffered_time": 30.0,
        "record_ttl": 120.0,
        "adaptive_batching": False,
    }
    async with Producer(**options) as producer:
        assert producer.oldest_record_age == 0.0
        first = await producer.submit(stream, b"first", "k")
        await anyio.sleep(0.5)
        later = [await producer.submit(stream, b"x", f"k{i}") for i in range(9)]
        await anyio.sleep(1.0)  # a one-second bucket closes meanwhile: a sample of 10 pending
        age = producer.oldest_record_age
        assert 1.4 <= age < 10.0, age  # the first record's age, not the later ones'
        statistics = producer.statistics()
        assert statistics.outstanding_records == 10
        assert statistics.oldest_record_age >= age
        pending = [v for v in producer.metrics("UserRecordsPending") if v.stream == stream]
        assert len(pending) == 1
        assert pending[0].max == 10
        await producer.flush()
        assert all(p.result().success for p in (first, *later))
        assert producer.oldest_record_age == 0.0
        assert producer.statistics().oldest_record_age == 0.0
        assert producer.outstanding_records == 0


async def test_aclose_from_another_task(make_stream: Any, producer_options: dict[str, Any]) -> None:
    stream = make_stream(1)
    async with Producer(**producer_options) as producer, anyio.create_task_group() as tg:
        result = await producer.put_record(stream, b"x", "k")
        assert result.success
        tg.start_soon(producer.aclose)
        with anyio.fail_after(10):
            while True:
                try:
                    await producer.submit(stream, b"y", "k")
                except errors.ProducerClosedError:
                    break
                await anyio.sleep(0.01)


async def test_aclose_on_a_producer_never_opened() -> None:
    producer = Producer(region="us-east-1")
    await producer.aclose()
    with pytest.raises(errors.ProducerClosedError):
        await producer.submit("stream", b"x", "k")


async def test_flush_of_one_stream_waits_for_that_stream_only(
    make_stream: Any, producer_options: dict[str, Any]
) -> None:
    first, second = make_stream(1), make_stream(1)
    # records wait in the aggregator until their buffered time is up, unless flushed (the
    # KPL's batching: adaptive batching would send them while nothing is in flight)
    options = {
        **producer_options,
        "record_max_buffered_time": 30.0,
        "record_ttl": 120.0,
        "adaptive_batching": False,
    }
    async with Producer(**options) as producer:
        # both shard maps ready first
        warm = [await producer.submit(s, b"warm", "k") for s in (first, second)]
        await producer.flush()
        assert all(p.result().success for p in warm)
        ones = [await producer.submit(first, b"1" * 50, f"k{i}") for i in range(20)]
        twos = [await producer.submit(second, b"2" * 50, f"k{i}") for i in range(20)]
        with anyio.fail_after(10):
            await producer.flush(stream=first)
        assert all(p.done() and p.result().success for p in ones)
        assert not any(p.done() for p in twos)
        await producer.flush(stream="a-stream-never-seen")  # nothing to wait for
        with anyio.fail_after(10):
            await producer.flush()
        assert all(p.done() and p.result().success for p in twos)


async def test_an_idle_stream_is_closed_and_opened_again(
    make_stream: Any, producer_options: dict[str, Any]
) -> None:
    stream = make_stream(2)
    async with Producer(**producer_options, stream_idle_timeout=0.4) as producer:
        assert (await producer.put_record(stream, b"x", "k")).success
        assert stream in producer.statistics().streams
        for _ in range(200):
            if stream not in producer.statistics().streams:
                break
            await anyio.sleep(0.05)
        else:
            raise AssertionError("the idle stream's pipeline was not closed within 10 s")
        # the next put opens it again, with a fresh shard map
        result = await producer.put_record(stream, b"y", "k")
        assert result.success
        assert producer.statistics().streams[stream].shard_map_state == "READY"


async def test_a_busy_stream_is_not_closed(
    make_stream: Any, producer_options: dict[str, Any]
) -> None:
    stream = make_stream(1)
    async with Producer(**producer_options, stream_idle_timeout=0.4) as producer:
        await producer.put_record(stream, b"x", "k")
        pipeline_stats = producer.statistics().streams[stream]
        # a record every 0.1 s for 1.2 s: never idle for 0.4 s
        for i in range(12):
            assert (await producer.put_record(stream, b"x", f"k{i}")).success
            await anyio.sleep(0.1)
        received = producer.statistics().streams[stream].user_records_received
        assert received == pipeline_stats.user_records_received + 12


class _CountingTransport:
    """The real aiobotocore transport, counting ListShards calls."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self.list_shards_calls = 0

    async def put_records(self, stream: str, records: list[dict[str, Any]]) -> Mapping[str, Any]:
        return await self._transport.put_records(stream, records)

    async def list_shards(self, **kwargs: Any) -> Mapping[str, Any]:
        self.list_shards_calls += 1
        return await self._transport.list_shards(**kwargs)


@asynccontextmanager
async def _counting(config: ProducerConfig) -> AsyncIterator[_CountingTransport]:
    async with open_transport(config) as transport:
        yield _CountingTransport(transport)


async def test_a_missing_stream_fails_fast_and_stops_listing_shards(
    producer_options: dict[str, Any],
) -> None:
    config = ProducerConfig(**producer_options)
    async with (
        _counting(config) as transport,
        Producer(config, transport=transport, stream_idle_timeout=None) as producer,
    ):
        for _ in range(2):
            started = anyio.current_time()
            with pytest.raises(errors.RecordFailedError) as caught:
                await producer.put_record("no-such-stream", b"x", "k")
            assert caught.value.result.attempts[-1].error_code == "ResourceNotFoundException"
            assert anyio.current_time() - started < 5.0
            calls = transport.list_shards_calls
            # idle: ListShards is not tried again on its own (it was, every 1-30 s, for ever)
            await anyio.sleep(3.0)
            assert transport.list_shards_calls == calls
        assert calls >= 1
