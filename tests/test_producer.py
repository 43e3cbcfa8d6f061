"""The Producer end to end over a fake Kinesis transport, on asyncio and trio.

Timing: small real durations with generous bounds, or trio's ``MockClock`` (autojump) for the
tests whose logic is about time (rate limits, TTLs), so nothing here sleeps for long.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import TaskGroup
from botocore.exceptions import ClientError, EndpointConnectionError

from anykpl import (
    BatchResult,
    PendingBatch,
    PendingRecord,
    Producer,
    ProducerConfig,
    RecordResult,
    errors,
)
from anykpl._core._collector import Collector
from anykpl._core._intake import CHECKPOINT_EVERY
from anykpl._core._limiter import EXPIRY_SCAN_INTERVAL
from anykpl._core._limits import MAX_HASH_KEY as MAX_HASH
from anykpl._core._wire import deaggregate
from anykpl._runtime._spool import Spool

from .fakes import FakeKinesis, GatedKinesis, even_ranges, hash_of

pytestmark = pytest.mark.anyio

STREAM = "stream"
THROTTLED = errors.THROTTLED

# fast retries, short buffering: the defaults are tuned for production, not for tests
# (and a short close: a failed assertion inside a block must not wait 30 s for a hung flush)
FAST: dict[str, Any] = {
    "record_max_buffered_time": 0.01,
    "retry_backoff_initial": 0.001,
    "retry_backoff_max": 0.01,
    "close_timeout": 2.0,
}


def _ten_records_a_second(fake: FakeKinesis, **overrides: Any) -> Producer:
    """A producer whose shards take 10 records/s (1 % of the limit), records unaggregated,
    with a 0.5 s TTL."""
    options = {"aggregation_enabled": False, "rate_limit": 1.0, "record_ttl": 0.5, **FAST}
    return Producer(transport=fake, **{**options, **overrides})


#: Shards of the fakes whose records are spread one to a shard (``spread``).
SPREAD_SHARDS = 10


def spread(i: int) -> int:
    """An explicit hash key on shard ``i % SPREAD_SHARDS`` of a fake with SPREAD_SHARDS
    shards: each record on a shard of its own, so that the producer's caps bind, not the last
    part of them that is kept for quiet shards (``RESERVE``)."""
    return even_ranges(SPREAD_SHARDS)[i % SPREAD_SHARDS][0]


def fast(**overrides: Any) -> dict[str, Any]:
    return {**FAST, **overrides}


def client_error(code: str, status: int = 400, message: str = "boom") -> ClientError:
    return ClientError(
        {
            "Error": {"Code": code, "Message": message},
            "ResponseMetadata": {"HTTPStatusCode": status},
        },
        "PutRecords",
    )


async def ready(producer: Producer, stream: str = STREAM, *, ehk: int = MAX_HASH) -> None:
    """Put one warm-up record (on the last shard by default) and wait for the shard map."""
    pending = await producer.submit(
        stream, b"warmup", partition_key="warmup", explicit_hash_key=ehk
    )
    await producer.flush()
    await pending
    await wait_until(lambda: producer.statistics().streams[stream].shard_map_state == "READY")


async def wait_until(predicate: Callable[[], bool]) -> None:
    """Poll ``predicate`` for state that has no event to wait on."""
    with anyio.fail_after(5):
        while not predicate():  # noqa: ASYNC110
            await anyio.sleep(0.001)


def stored(fake: FakeKinesis, *, warmup: bool = False) -> Counter[bytes]:
    """What the fake stored, deaggregated, by data (the warm-up record left out)."""
    counts = Counter(r.data for r in fake.user_records())
    if not warmup:
        counts.pop(b"warmup", None)
    return counts


def failure(pending: PendingRecord) -> errors.RecordFailedError:
    assert pending.done()
    with pytest.raises(errors.RecordFailedError) as info:
        pending.result()
    return info.value


def range_of(fake: FakeKinesis, shard_id: str) -> tuple[int, int]:
    shard = next(s for s in fake.shards if s.shard_id == shard_id)
    return shard.start, shard.end


def assert_stored_where_reported(fake: FakeKinesis, data: bytes, result: RecordResult) -> None:
    shard = next(s for s in fake.shards if s.shard_id == result.shard_id)
    (pk, blob) = next(
        (pk, blob) for pk, blob, seq in shard.records if seq == result.sequence_number
    )
    assert result.sub_sequence_number is not None
    assert deaggregate(blob, pk)[result.sub_sequence_number].data == data


# -- the happy path ----------------------------------------------------------------------------


async def test_put_record_returns_its_result(fake_kinesis: FakeKinesis) -> None:
    # a buffering time long enough that a loaded machine cannot blur the two cases below
    options = {**FAST, "record_max_buffered_time": 1.0}
    async with Producer(transport=fake_kinesis, **options) as producer:
        called = anyio.current_time()
        result = await producer.put_record(STREAM, b"hello", partition_key="k")
        returned = anyio.current_time()
    assert isinstance(result, RecordResult)
    assert result.success
    lo, hi = range_of(fake_kinesis, str(result.shard_id))
    assert lo <= hash_of("k") <= hi
    assert result.sequence_number is not None
    assert result.sub_sequence_number == 0
    (attempt,) = result.attempts
    assert attempt.success
    # nothing else in flight: the lone record goes at once (adaptive batching), not after
    # record_max_buffered_time (the producer's clock is the backend's, the same as anyio's),
    # and both intervals lie inside the call
    assert attempt.delay < options["record_max_buffered_time"] / 2
    assert attempt.delay + attempt.duration <= returned - called
    assert attempt.error_code is None
    assert [(r.partition_key, r.data) for r in fake_kinesis.user_records()] == [("k", b"hello")]


async def test_without_adaptive_batching_a_lone_record_waits_its_buffered_time(
    fake_kinesis: FakeKinesis,
) -> None:
    """The KPL's batching, one setting away: the record waits out record_max_buffered_time."""
    async with Producer(transport=fake_kinesis, adaptive_batching=False, **FAST) as producer:
        called = anyio.current_time()
        result = await producer.put_record(STREAM, b"hello", partition_key="k")
        returned = anyio.current_time()
    (attempt,) = result.attempts
    assert attempt.delay >= FAST["record_max_buffered_time"] - 0.001
    assert attempt.delay + attempt.duration <= returned - called


async def test_many_records_are_aggregated_and_all_delivered(fake_kinesis: FakeKinesis) -> None:
    async with Producer(transport=fake_kinesis, **FAST) as producer:
        await ready(producer)
        pendings = [
            await producer.submit(STREAM, b"%d" % i, partition_key=f"k{i}") for i in range(300)
        ]
        await producer.flush()
        assert all(p.done() for p in pendings)
        results = [await p for p in pendings]
    assert stored(fake_kinesis) == Counter(b"%d" % i for i in range(300))
    # aggregation: far fewer Kinesis records than user records
    assert sum(len(request) for request in fake_kinesis.requests) < 50
    for i, result in enumerate(results):
        assert_stored_where_reported(fake_kinesis, b"%d" % i, result)
        lo, hi = range_of(fake_kinesis, str(result.shard_id))
        assert lo <= hash_of(f"k{i}") <= hi


@pytest.mark.parametrize("data", [bytearray(b"abc"), memoryview(b"abc")], ids=type)
async def test_bytes_like_data_is_accepted(
    fake_kinesis: FakeKinesis, data: bytearray | memoryview
) -> None:
    async with Producer(transport=fake_kinesis, **FAST) as producer:
        await producer.put_record(STREAM, data, partition_key="k")
    assert [r.data for r in fake_kinesis.user_records()] == [b"abc"]


async def test_random_partition_key_when_omitted(fake_kinesis: FakeKinesis) -> None:
    async with Producer(transport=fake_kinesis, **FAST) as producer:
        first = await producer.submit(STREAM, b"one")
        second = await producer.submit(STREAM, b"two")
        assert first.partition_key != second.partition_key
        await first
        await second
    keys = {r.data: r.partition_key for r in fake_kinesis.user_records()}
    assert set(keys) == {b"one", b"two"}
    for key in keys.values():
        assert 1 <= len(key) <= 256
    assert keys[b"one"] != keys[b"two"]


async def test_explicit_hash_key_places_the_record(fake_kinesis: FakeKinesis) -> None:
    async with Producer(transport=fake_kinesis, **FAST) as producer:
        await ready(producer)
        for i, (start, end) in enumerate(even_ranges(4)):
            for key in (start, end, str(end)):
                result = await producer.put_record(
                    STREAM, b"x", partition_key="same", explicit_hash_key=key
                )
                assert result.shard_id == f"shardId-{i:012d}"


async def test_config_and_overrides() -> None:
    config = ProducerConfig(record_ttl=5.0)
    producer = Producer(config, rate_limit=50.0)
    assert producer.config.record_ttl == 5.0
    assert producer.config.rate_limit == 50.0
    assert config.rate_limit == 100.0  # frozen: the original is untouched
    assert Producer(record_ttl=7.0).config.record_ttl == 7.0
    with pytest.raises(errors.ConfigError, match="rate_limit"):
        Producer(rate_limit=0.5)
    with pytest.raises(errors.ConfigError, match="rate_limit"):
        Producer(config, rate_limit=0.5)


# -- bad input ----------------------------------------------------------------------------------

BAD_INPUT = [
    pytest.param({"data": "text"}, errors.RecordTypeError, id="str-data"),
    pytest.param({"data": 12}, errors.RecordTypeError, id="int-data"),
    pytest.param({"data": None}, errors.RecordTypeError, id="none-data"),
    pytest.param({"partition_key": ""}, errors.InvalidRecordError, id="empty-key"),
    pytest.param({"partition_key": "k" * 257}, errors.InvalidRecordError, id="257-char-key"),
    pytest.param({"partition_key": 7}, errors.RecordTypeError, id="int-key"),
    pytest.param({"partition_key": "\ud800"}, errors.InvalidRecordError, id="surrogate-key"),
    pytest.param({"explicit_hash_key": "abc"}, errors.InvalidRecordError, id="ehk-abc"),
    pytest.param({"explicit_hash_key": "-1"}, errors.InvalidRecordError, id="ehk-minus-1"),
    pytest.param({"explicit_hash_key": -1}, errors.InvalidRecordError, id="ehk-int-minus-1"),
    pytest.param({"explicit_hash_key": ""}, errors.InvalidRecordError, id="ehk-empty"),
    pytest.param({"explicit_hash_key": "1.5"}, errors.InvalidRecordError, id="ehk-1.5"),
    pytest.param({"explicit_hash_key": "\u0661"}, errors.InvalidRecordError, id="ehk-arabic-1"),
    pytest.param({"explicit_hash_key": 2**128}, errors.InvalidRecordError, id="ehk-2**128"),
    pytest.param(
        {"explicit_hash_key": str(2**128)}, errors.InvalidRecordError, id="ehk-str-2**128"
    ),
    pytest.param({"explicit_hash_key": 1.0}, errors.RecordTypeError, id="ehk-float"),
    pytest.param({"explicit_hash_key": True}, errors.RecordTypeError, id="ehk-bool"),
    pytest.param(
        {"data": bytes(1021), "partition_key": "abcd"}, errors.InvalidRecordError, id="too-big"
    ),
    pytest.param(
        {"data": bytes(1023), "partition_key": "é"}, errors.InvalidRecordError, id="too-big-utf8"
    ),
    pytest.param({"stream": ""}, errors.InvalidRecordError, id="empty-stream"),
    pytest.param({"stream": "has space"}, errors.InvalidRecordError, id="stream-space"),
    pytest.param({"stream": "s" * 129}, errors.InvalidRecordError, id="stream-129"),
    pytest.param({"stream": "strëam"}, errors.InvalidRecordError, id="stream-non-ascii"),
    pytest.param({"stream": "a/b"}, errors.InvalidRecordError, id="stream-slash"),
    pytest.param({"stream": b"stream"}, errors.RecordTypeError, id="stream-bytes"),
]


@pytest.mark.parametrize(("overrides", "error"), BAD_INPUT)
@pytest.mark.parametrize("method", ["submit", "put_record"])
async def test_bad_input_raises_at_the_call_and_enqueues_nothing(
    fake_kinesis: FakeKinesis, overrides: dict[str, Any], error: type[Exception], method: str
) -> None:
    call: dict[str, Any] = {"stream": STREAM, "data": b"data", "partition_key": "k"}
    call.update(overrides)
    base = ValueError if issubclass(error, ValueError) else TypeError
    async with Producer(transport=fake_kinesis, max_user_record_size=1024, **FAST) as producer:
        with pytest.raises(error) as info:
            await getattr(producer, method)(**call)
        assert isinstance(info.value, base)
        assert isinstance(info.value, errors.AnyKplError)
        assert producer.outstanding_records == 0
        statistics = producer.statistics()
        assert statistics.outstanding_bytes == 0
        assert all(s.user_records_received == 0 for s in statistics.streams.values())
        await producer.flush()
    assert fake_kinesis.requests == []


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"partition_key": "k" * 256}, id="256-char-key"),
        pytest.param({"partition_key": "\u00e9" * 256}, id="256-non-ascii-chars"),
        pytest.param({"explicit_hash_key": "0"}, id="ehk-0"),
        pytest.param({"explicit_hash_key": 0}, id="ehk-int-0"),
        pytest.param({"explicit_hash_key": str(MAX_HASH)}, id="ehk-max"),
        pytest.param({"explicit_hash_key": "007"}, id="ehk-leading-zeros"),
        pytest.param({"data": bytes(1020), "partition_key": "abcd"}, id="exactly-max-size"),
        pytest.param({"data": b""}, id="empty-data"),
        pytest.param({"stream": "My_Stream.name-1"}, id="stream-punctuation"),
        pytest.param({"stream": "s" * 128}, id="stream-128"),
    ],
)
async def test_edge_inputs_are_accepted(
    fake_kinesis: FakeKinesis, overrides: dict[str, Any]
) -> None:
    call: dict[str, Any] = {"stream": STREAM, "data": b"data", "partition_key": "k"}
    call.update(overrides)
    async with Producer(transport=fake_kinesis, max_user_record_size=1024, **FAST) as producer:
        result = await producer.put_record(**call)
    assert result.success
    ehk = call.get("explicit_hash_key")
    if ehk is not None:
        lo, hi = range_of(fake_kinesis, str(result.shard_id))
        assert lo <= int(ehk) <= hi


async def test_put_before_open_and_after_close(fake_kinesis: FakeKinesis) -> None:
    producer = Producer(transport=fake_kinesis, **FAST)
    with pytest.raises(errors.ProducerClosedError):
        await producer.submit(STREAM, b"early", partition_key="k")
    async with producer:
        await producer.put_record(STREAM, b"inside", partition_key="k")
    with pytest.raises(errors.ProducerClosedError):
        await producer.put_record(STREAM, b"late", partition_key="k")
    with pytest.raises(errors.ProducerClosedError):
        await producer.submit(STREAM, b"late", partition_key="k")
    assert [r.data for r in fake_kinesis.user_records()] == [b"inside"]


async def test_a_producer_is_entered_only_once(fake_kinesis: FakeKinesis) -> None:
    producer = Producer(transport=fake_kinesis, **FAST)
    async with producer:
        pass
    with pytest.raises(RuntimeError):
        async with producer:
            pass


async def test_put_during_close_is_refused() -> None:
    fake = GatedKinesis()
    refused: list[BaseException] = []

    async def put_while_closing(producer: Producer) -> None:
        assert fake.entered is not None
        await fake.entered.wait()  # the closing flush is sending
        try:
            await producer.submit(STREAM, b"too late", partition_key="k")
        except errors.ProducerClosedError as exc:
            refused.append(exc)
        finally:
            assert fake.gate is not None
            fake.gate.set()

    async with (
        anyio.create_task_group() as tg,
        Producer(transport=fake, record_max_buffered_time=10.0, close_timeout=2.0) as producer,
    ):
        await ready(producer)
        fake.close_gate()
        pending = await producer.submit(STREAM, b"in time", partition_key="k")
        tg.start_soon(put_while_closing, producer)
    assert len(refused) == 1
    assert (await pending).success
    assert stored(fake) == Counter([b"in time"])


# -- failures and retries ---------------------------------------------------------------------


@pytest.mark.parametrize("aggregation_enabled", [True, False], ids=["aggregated", "raw"])
async def test_throttling_storm_delivers_every_record_exactly_once(
    fake_kinesis: FakeKinesis, aggregation_enabled: bool
) -> None:
    calls = Counter[str]()

    def throttle_shard_0(shard_id: str, index: int) -> tuple[str, str] | None:
        calls[shard_id] += 1
        if shard_id == "shardId-000000000000" and calls[shard_id] <= 25:
            return (THROTTLED, "Rate exceeded for shard")
        return None

    expected = [b"record-%d" % i for i in range(200)]
    async with Producer(
        transport=fake_kinesis, aggregation_enabled=aggregation_enabled, **FAST
    ) as producer:
        await ready(producer)
        fake_kinesis.entry_error = throttle_shard_0
        pendings = [
            await producer.submit(STREAM, data, partition_key=f"pk-{i}")
            for i, data in enumerate(expected)
        ]
        with anyio.fail_after(20):
            results = [await p for p in pendings]
        statistics = producer.statistics()
    assert stored(fake_kinesis) == Counter(expected)
    throttled = [r for r in results if any(a.error_code == THROTTLED for a in r.attempts)]
    assert throttled
    assert all(r.shard_id == "shardId-000000000000" for r in throttled)
    assert all(r.success and r.attempts[-1].success for r in results)
    assert statistics.errors_by_code[THROTTLED] == 25
    assert statistics.outstanding_records == 0


async def test_request_errors_are_retried_in_order_of_their_codes(
    fake_kinesis: FakeKinesis,
) -> None:
    async with Producer(transport=fake_kinesis, **FAST) as producer:
        await ready(producer)
        fake_kinesis.request_errors = [
            client_error("", status=500),
            client_error("InternalFailure", status=500),
            client_error("ServiceUnavailable", status=503),
            ConnectionResetError("reset by peer"),
            EndpointConnectionError(endpoint_url="https://kinesis.example"),
            TimeoutError(),
        ]
        with anyio.fail_after(10):
            result = await producer.put_record(STREAM, b"stubborn", partition_key="k")
    assert [a.error_code for a in result.attempts] == [
        "HTTP500",
        "InternalFailure",
        "ServiceUnavailable",
        errors.CONNECTION_ERROR,
        errors.CONNECTION_ERROR,
        errors.TIMEOUT,
        None,
    ]
    assert result.success
    assert stored(fake_kinesis) == Counter([b"stubborn"])


async def test_request_errors_lose_and_duplicate_nothing(fake_kinesis: FakeKinesis) -> None:
    async with Producer(transport=fake_kinesis, **FAST) as producer:
        await ready(producer)
        fake_kinesis.request_errors = [client_error("", status=500)] * 3 + [OSError("reset")] * 3
        expected = [b"r%d" % i for i in range(100)]
        pendings = [await producer.submit(STREAM, d, partition_key=d.decode()) for d in expected]
        with anyio.fail_after(10):
            for p in pendings:
                await p
        statistics = producer.statistics()
    assert stored(fake_kinesis) == Counter(expected)
    assert statistics.errors_by_code.get("HTTP500") == 3
    assert statistics.errors_by_code.get(errors.CONNECTION_ERROR) == 3


@pytest.mark.parametrize(
    "code", ["ResourceNotFoundException", "AccessDeniedException", "KMSDisabledException"]
)
async def test_non_retriable_request_error_fails_fast(fake_kinesis: FakeKinesis, code: str) -> None:
    async with Producer(transport=fake_kinesis, record_ttl=30.0, **FAST) as producer:
        await ready(producer)
        fake_kinesis.request_errors = [client_error(code)]
        start = anyio.current_time()
        with anyio.fail_after(5), pytest.raises(errors.RecordFailedError) as info:
            await producer.put_record(STREAM, b"doomed", partition_key="k")
        assert anyio.current_time() - start < 5
    assert info.value.error_code == code
    (attempt,) = info.value.result.attempts
    assert not attempt.success
    assert attempt.error_message == "boom"
    assert not info.value.result.success
    assert info.value.result.shard_id is None


async def test_non_retriable_record_error_fails_fast(fake_kinesis: FakeKinesis) -> None:
    async with Producer(transport=fake_kinesis, record_ttl=30.0, **FAST) as producer:
        await ready(producer)
        fake_kinesis.entry_error = lambda shard, index: ("KMSAccessDeniedException", "no key")
        with anyio.fail_after(5), pytest.raises(errors.RecordFailedError) as info:
            await producer.put_record(STREAM, b"doomed", partition_key="k")
    assert info.value.error_code == "KMSAccessDeniedException"
    assert len(info.value.result.attempts) == 1


async def test_missing_stream_fails_fast_even_before_the_shard_map(
    fake_kinesis: FakeKinesis,
) -> None:
    fake_kinesis.list_shards_errors = [client_error("ResourceNotFoundException")] * 3
    fake_kinesis.request_errors = [client_error("ResourceNotFoundException")]
    async with Producer(transport=fake_kinesis, record_ttl=30.0, **FAST) as producer:
        with anyio.fail_after(5), pytest.raises(errors.RecordFailedError) as info:
            await producer.put_record(STREAM, b"doomed", partition_key="k")
    assert info.value.error_code == "ResourceNotFoundException"


async def test_fail_if_throttled(fake_kinesis: FakeKinesis) -> None:
    async with Producer(transport=fake_kinesis, fail_if_throttled=True, **FAST) as producer:
        await ready(producer)
        fake_kinesis.entry_error = lambda shard, index: (THROTTLED, "slow down")
        with anyio.fail_after(5), pytest.raises(errors.RecordFailedError) as info:
            await producer.put_record(STREAM, b"x", partition_key="k")
    assert info.value.error_code == THROTTLED
    assert len(info.value.result.attempts) == 1


async def test_ttl_expiry_ends_with_an_expired_attempt(fake_kinesis: FakeKinesis) -> None:
    # (a TTL of a second: on a loaded machine, a shorter one expired the warm-up record)
    async with Producer(transport=fake_kinesis, record_ttl=1.0, **FAST) as producer:
        await ready(producer)
        fake_kinesis.entry_error = lambda shard, index: (THROTTLED, "slow down")
        start = anyio.current_time()
        with anyio.fail_after(10), pytest.raises(errors.RecordFailedError) as info:
            await producer.put_record(STREAM, b"late", partition_key="k")
        elapsed = anyio.current_time() - start
    assert elapsed >= 1.0
    attempts = info.value.result.attempts
    assert info.value.error_code == errors.EXPIRED
    assert attempts[-1].error_code == errors.EXPIRED
    assert len(attempts) >= 3
    assert all(a.error_code == THROTTLED for a in attempts[:-1])
    assert stored(fake_kinesis) == Counter()


async def test_record_count_mismatch_fails_the_request(fake_kinesis: FakeKinesis) -> None:
    async with Producer(transport=fake_kinesis, **FAST) as producer:
        await ready(producer)
        fake_kinesis.drop_response_entry = True
        with anyio.fail_after(5), pytest.raises(errors.RecordFailedError) as info:
            await producer.put_record(STREAM, b"x", partition_key="k")
    assert info.value.error_code == errors.RECORD_COUNT_MISMATCH


async def test_wrong_shard_after_a_split_is_retried_into_the_children() -> None:
    fake = FakeKinesis(shard_count=2)
    parent_start, parent_end = fake.shards[0].start, fake.shards[0].end
    async with Producer(transport=fake, **FAST) as producer:
        await ready(producer)
        fake.split("shardId-000000000000")
        children = {"shardId-000000000002", "shardId-000000000003"}
        step = (parent_end - parent_start) // 20
        keys = [parent_start + i * step for i in range(20)] + [parent_end]
        pendings = [
            await producer.submit(STREAM, b"%d" % i, partition_key=f"k{i}", explicit_hash_key=key)
            for i, key in enumerate(keys)
        ]
        with anyio.fail_after(10):
            results = [await p for p in pendings]
        statistics = producer.statistics().streams[STREAM]
    for i, (key, result) in enumerate(zip(keys, results, strict=True)):
        assert result.success
        assert result.shard_id in children
        lo, hi = range_of(fake, str(result.shard_id))
        assert lo <= key <= hi
        assert_stored_where_reported(fake, b"%d" % i, result)
    assert any(a.error_code == errors.WRONG_SHARD for r in results for a in r.attempts), (
        "the stale prediction was not noticed"
    )
    assert len(fake.list_shards_calls) >= 2  # refreshed
    assert "shardId-000000000000" not in statistics.open_shards
    assert children <= set(statistics.open_shards)


@pytest.mark.parametrize("list_shards_fails", [False, True])
async def test_an_aggregate_that_lands_in_a_child_the_map_has_not_seen_is_stored_once(
    list_shards_fails: bool,
) -> None:
    """After a split the stale map sends an aggregate of several keys to the parent; the
    service stores it in a child the map does not know. Every key is in that child's range:
    the records are delivered there, after the refresh shows the range, and not sent again
    (also when the first refresh fails with an error worth retrying: they wait for the next)."""
    fake = FakeKinesis(shard_count=2)
    parent_start, parent_end = fake.shards[0].start, fake.shards[0].end
    async with Producer(transport=fake, **FAST) as producer:
        await ready(producer)
        fake.split("shardId-000000000000")
        if list_shards_fails:
            fake.list_shards_errors = [client_error("LimitExceededException")]
        lower = "shardId-000000000002"
        step = ((parent_start + parent_end) // 2 - parent_start) // 10
        keys = [parent_start + i * step for i in range(10)]
        pendings = [
            await producer.submit(STREAM, b"%d" % i, partition_key=f"k{i}", explicit_hash_key=key)
            for i, key in enumerate(keys)
        ]
        with anyio.fail_after(10):
            results = [await p for p in pendings]
    assert [r.shard_id for r in results] == [lower] * len(keys)
    assert all(len(r.attempts) == 1 and r.attempts[0].success for r in results)
    assert stored(fake) == Counter(b"%d" % i for i in range(len(keys)))
    for i, result in enumerate(results):
        assert_stored_where_reported(fake, b"%d" % i, result)
    assert len(fake.list_shards_calls) >= 2  # refreshed
    assert not fake.list_shards_errors  # (the failure happened)


# -- backpressure ------------------------------------------------------------------------------


async def test_backpressure_on_outstanding_records() -> None:
    fake = GatedKinesis(SPREAD_SHARDS)
    async with Producer(transport=fake, max_outstanding_records=10, **FAST) as producer:
        await ready(producer)
        fake.close_gate()
        pendings = [
            await producer.submit(STREAM, b"%d" % i, partition_key="k", explicit_hash_key=spread(i))
            for i in range(10)
        ]
        assert producer.outstanding_records == 10
        # the 11th waits for room
        admitted: list[PendingRecord] = []

        async def eleventh() -> None:
            admitted.append(await producer.submit(STREAM, b"10", partition_key="k"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(eleventh)
            await anyio.sleep(0.1)
            assert admitted == []
            assert producer.outstanding_records == 10
            assert fake.gate is not None
            fake.gate.set()
        assert len(admitted) == 1
        await producer.flush()
        for p in [*pendings, *admitted]:
            assert (await p).success
    assert stored(fake) == Counter(b"%d" % i for i in range(11))


async def test_admission_timeout_on_outstanding_records() -> None:
    fake = GatedKinesis(SPREAD_SHARDS)
    async with Producer(
        transport=fake, max_outstanding_records=10, admission_timeout=0.1, **FAST
    ) as producer:
        await ready(producer)
        fake.close_gate()
        for i in range(10):
            await producer.submit(STREAM, b"%d" % i, partition_key="k", explicit_hash_key=spread(i))
        start = anyio.current_time()
        with pytest.raises(errors.BackpressureTimeout):
            await producer.submit(STREAM, b"10", partition_key="k")
        assert anyio.current_time() - start >= 0.09
        with pytest.raises(errors.BackpressureTimeout):
            await producer.put_record(STREAM, b"11", partition_key="k")
        assert producer.outstanding_records == 10
        assert fake.gate is not None
        fake.gate.set()
    assert stored(fake) == Counter(b"%d" % i for i in range(10))


async def test_backpressure_on_outstanding_bytes() -> None:
    fake = GatedKinesis(SPREAD_SHARDS)
    async with Producer(
        transport=fake, max_outstanding_bytes=1024, admission_timeout=0.1, **FAST
    ) as producer:
        await ready(producer)
        fake.close_gate()
        # each on a shard of its own: the producer's cap binds, not its reserve for quiet shards
        await producer.submit(STREAM, bytes(500), partition_key="a", explicit_hash_key=spread(0))
        await producer.submit(STREAM, bytes(500), partition_key="b", explicit_hash_key=spread(1))
        assert producer.statistics().outstanding_bytes == 1002
        with pytest.raises(errors.BackpressureTimeout):
            await producer.submit(
                STREAM, bytes(500), partition_key="c", explicit_hash_key=spread(2)
            )
        # a smaller record still fits
        await producer.submit(STREAM, bytes(10), partition_key="d", explicit_hash_key=spread(3))
        statistics = producer.statistics()
        assert statistics.outstanding_records == 3
        assert statistics.outstanding_bytes == 1013
        assert fake.gate is not None
        fake.gate.set()
        await producer.flush()
        # room again
        await producer.submit(STREAM, bytes(500), partition_key="c")
    assert sorted(len(d) for d in stored(fake).elements()) == [10, 500, 500, 500]


async def test_a_record_bigger_than_max_outstanding_bytes_is_admitted_alone(
    fake_kinesis: FakeKinesis,
) -> None:
    async with Producer(transport=fake_kinesis, max_outstanding_bytes=1024, **FAST) as producer:
        result = await producer.put_record(STREAM, bytes(5000), partition_key="k")
    assert result.success


# -- flush and close ---------------------------------------------------------------------------


async def test_flush_waits_for_every_outcome(fake_kinesis: FakeKinesis) -> None:
    # a long buffer time: without the flush nothing would be sent for 10 s
    async with Producer(transport=fake_kinesis, **fast(record_max_buffered_time=10.0)) as producer:
        await ready(producer)
        pendings = [
            await producer.submit(STREAM, b"%d" % i, partition_key=f"{i}") for i in range(50)
        ]
        assert not any(p.done() for p in pendings)
        with anyio.fail_after(5):
            await producer.flush()
        assert all(p.done() for p in pendings)
        assert all(p.result().success for p in pendings)
        assert producer.outstanding_records == 0
    assert stored(fake_kinesis) == Counter(b"%d" % i for i in range(50))


async def test_flush_timeout_does_not_fail_the_records() -> None:
    fake = GatedKinesis()
    async with Producer(transport=fake, **FAST) as producer:
        await ready(producer)
        fake.close_gate()
        pendings = [
            await producer.submit(STREAM, b"%d" % i, partition_key=f"{i}") for i in range(5)
        ]
        with pytest.raises(errors.FlushTimeout):
            await producer.flush(timeout=0.1)
        assert not any(p.done() for p in pendings)
        assert producer.outstanding_records == 5
        assert fake.gate is not None
        fake.gate.set()
        await producer.flush(timeout=5)
        assert all(p.result().success for p in pendings)
    assert stored(fake) == Counter(b"%d" % i for i in range(5))


async def test_leaving_the_block_flushes(fake_kinesis: FakeKinesis) -> None:
    async with Producer(transport=fake_kinesis, **fast(record_max_buffered_time=10.0)) as producer:
        await ready(producer)
        pendings = [
            await producer.submit(STREAM, b"%d" % i, partition_key=f"{i}") for i in range(20)
        ]
    assert all(p.result().success for p in pendings)
    assert stored(fake_kinesis) == Counter(b"%d" % i for i in range(20))


async def test_close_with_a_hanging_transport_is_bounded(fake_kinesis: FakeKinesis) -> None:
    async with Producer(transport=fake_kinesis, **fast(close_timeout=0.2)) as producer:
        await ready(producer)
        fake_kinesis.hang = True
        pendings = [
            await producer.submit(STREAM, b"%d" % i, partition_key=f"{i}") for i in range(20)
        ]
        start = anyio.current_time()
    assert anyio.current_time() - start < 2.0
    for pending in pendings:
        exc = failure(pending)
        assert exc.error_code == errors.PRODUCER_CLOSED
        assert exc.result.attempts[-1].error_code == errors.PRODUCER_CLOSED
    with pytest.raises(errors.RecordFailedError):
        await pendings[0]


async def test_cancelling_the_scope_around_the_producer_ends_it_promptly(
    fake_kinesis: FakeKinesis,
) -> None:
    start = anyio.current_time()
    with anyio.CancelScope() as scope:
        async with Producer(transport=fake_kinesis, **fast(close_timeout=30.0)) as producer:
            await ready(producer)
            fake_kinesis.hang = True
            pendings = [
                await producer.submit(STREAM, b"%d" % i, partition_key=f"{i}") for i in range(10)
            ]
            scope.cancel()
            await anyio.sleep_forever()
    assert scope.cancelled_caught
    assert anyio.current_time() - start < 5.0
    for pending in pendings:
        assert failure(pending).error_code == errors.PRODUCER_CLOSED


async def test_move_on_after_around_a_hanging_put(fake_kinesis: FakeKinesis) -> None:
    with anyio.move_on_after(0.2) as scope:
        async with Producer(transport=fake_kinesis, **fast(close_timeout=30.0)) as producer:
            fake_kinesis.hang = True
            await producer.put_record(STREAM, b"x", partition_key="k")
    assert scope.cancelled_caught


# -- a crashing stage ----------------------------------------------------------------------------


async def test_a_crashing_stage_fails_every_pending_record(
    fake_kinesis: FakeKinesis, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_put(self: Collector, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(Collector, "put", broken_put)
    codes: list[str | None] = []

    async def wait_for(pending: PendingRecord) -> None:
        try:
            await pending
        except errors.RecordFailedError as exc:
            codes.append(exc.error_code)

    producer = Producer(transport=fake_kinesis, **FAST)

    admitted = 0

    async def run(waiters: TaskGroup) -> None:
        nonlocal admitted
        async with producer:
            for i in range(5):
                # submit may yield (it does while the shard map is not ready), so the crash can
                # come before all five are in: from then on the producer refuses new records
                try:
                    pending = await producer.submit(STREAM, b"%d" % i, partition_key=f"{i}")
                except errors.ProducerClosedError:
                    break
                admitted += 1
                waiters.start_soon(wait_for, pending)
            await anyio.sleep_forever()  # until the crash cancels the block

    with anyio.fail_after(5):
        async with anyio.create_task_group() as waiters:
            with pytest.raises(RuntimeError, match="boom"):
                await run(waiters)
    assert admitted >= 1
    assert codes == [errors.PIPELINE_FAILED] * admitted
    with pytest.raises(errors.ProducerClosedError):
        await producer.submit(STREAM, b"after", partition_key="k")
    crashes = [r for r in caplog.records if r.name == "anykpl.producer"]
    assert len(crashes) == 1
    assert crashes[0].levelname == "ERROR"
    assert "a pipeline stage crashed (RuntimeError: boom)" in crashes[0].getMessage()


async def test_a_crashing_transport_list_shards_fails_records_not_hangs(
    fake_kinesis: FakeKinesis, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Crash(BaseException):
        pass

    async def list_shards(**kwargs: Any) -> Mapping[str, Any]:
        await anyio.sleep(0.05)
        raise Crash("not an Exception")

    monkeypatch.setattr(fake_kinesis, "list_shards", list_shards)
    codes: list[str | None] = []

    async def put(producer: Producer) -> None:
        try:
            await producer.put_record(STREAM, b"x", partition_key="k")
        except errors.RecordFailedError as exc:
            codes.append(exc.error_code)

    async def run(outer: TaskGroup) -> None:
        async with Producer(transport=fake_kinesis, **FAST) as producer:
            outer.start_soon(put, producer)
            await anyio.sleep_forever()  # until the crash cancels the block

    fake_kinesis.hang = True
    with anyio.fail_after(5):
        async with anyio.create_task_group() as outer:
            with pytest.raises(Crash):
                await run(outer)
    assert codes == [errors.PIPELINE_FAILED]


# -- cancellation of a waiter -----------------------------------------------------------------


async def test_cancelling_a_waiter_does_not_cancel_its_record() -> None:
    fake = GatedKinesis()
    scopes: list[anyio.CancelScope] = []
    others: list[RecordResult] = []
    async with Producer(transport=fake, **FAST) as producer:
        await ready(producer)
        fake.close_gate()

        async def cancelled_put() -> None:
            with anyio.CancelScope() as scope:
                scopes.append(scope)
                await producer.put_record(STREAM, b"abandoned", partition_key="a")

        async def other_put() -> None:
            others.append(await producer.put_record(STREAM, b"other", partition_key="b"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancelled_put)
            tg.start_soon(other_put)
            await wait_until(lambda: producer.outstanding_records == 2)
            scopes[0].cancel()
            await anyio.sleep(0.02)
            assert producer.outstanding_records == 2
            assert fake.gate is not None
            fake.gate.set()
        assert scopes[0].cancelled_caught
        await producer.flush()
        assert producer.outstanding_records == 0
    assert len(others) == 1
    assert others[0].success
    assert stored(fake) == Counter([b"abandoned", b"other"])


async def test_cancelling_an_await_on_a_pending_record() -> None:
    fake = GatedKinesis()
    async with Producer(transport=fake, **FAST) as producer:
        await ready(producer)
        fake.close_gate()
        pending = await producer.submit(STREAM, b"x", partition_key="k")
        with anyio.move_on_after(0.05) as scope:
            await pending
        assert scope.cancelled_caught
        assert not pending.done()
        assert fake.gate is not None
        fake.gate.set()
        assert (await pending).success


# -- statistics -------------------------------------------------------------------------------


async def test_statistics_snapshot() -> None:
    fake = GatedKinesis()
    # (a retried record waits RMBT/2 in the aggregator: keep RMBT short enough for that)
    async with Producer(
        transport=fake, record_max_buffered_time=0.5, retry_backoff_max=0.05, close_timeout=2.0
    ) as producer:
        empty = producer.statistics()
        assert empty.outstanding_records == 0
        assert empty.streams == {}
        await ready(producer)
        # two records per shard, held in the aggregator by the buffer time
        keys = [start for start, _ in even_ranges(4)] * 2
        pendings = [
            await producer.submit(STREAM, bytes(10), partition_key="pk", explicit_hash_key=key)
            for key in keys
        ]
        statistics = producer.statistics()
        stream = statistics.streams[STREAM]
        assert statistics.outstanding_records == 8
        assert statistics.outstanding_bytes == 8 * 12
        assert stream.shard_map_state == "READY"
        assert stream.open_shards == tuple(s.shard_id for s in fake.shards)
        assert stream.aggregator_queue_depths == {s.shard_id: 2 for s in fake.shards}
        assert stream.user_records_received == 9
        assert stream.requests_in_flight == 0
        with pytest.raises(AttributeError):
            statistics.outstanding_records = 0  # type: ignore[misc]
        # send them into the closed gate
        fake.close_gate()
        with pytest.raises(errors.FlushTimeout):
            await producer.flush(timeout=0.2)
        stream = producer.statistics().streams[STREAM]
        assert stream.requests_in_flight == 1
        assert sum(stream.aggregator_queue_depths.values()) == 0
        assert set(stream.token_levels) == {s.shard_id for s in fake.shards}
        for records, nbytes in stream.token_levels.values():
            assert 0 <= records <= 1000
            assert nbytes <= 1024 * 1024
        assert set(stream.rates.values()) == {(1000.0, 1024.0 * 1024)}
        # now throttle: every first try on every shard
        seen = Counter[str]()

        def throttle_once(shard_id: str, index: int) -> tuple[str, str] | None:
            seen[shard_id] += 1
            return (THROTTLED, "slow down") if seen[shard_id] == 1 else None

        fake.entry_error = throttle_once
        assert fake.gate is not None
        fake.gate.set()
        fake.gate = None
        await producer.flush(timeout=5)
        await producer.flush(timeout=5)
        assert all(p.result().success for p in pendings)
        statistics = producer.statistics()
        assert statistics.outstanding_records == 0
        assert statistics.outstanding_bytes == 0
        assert statistics.errors_by_code == {THROTTLED: 4}
        assert statistics.streams[STREAM].retry_backoff_records == 0
        put = [
            v
            for k, v in statistics.metrics.items()
            if k.name == "UserRecordsPut" and k.stream is None and k.shard is None
        ]
        assert put == [9]


# -- time-heavy logic on trio's MockClock ----------------------------------------------------


@pytest.mark.autojump
class TestOnMockClock:
    async def test_statistics_token_levels_at_time_zero(self) -> None:
        # MockClock starts at 0.0, a time like any other (nothing here sleeps)
        fake = FakeKinesis()
        async with Producer(transport=fake, **fast(record_max_buffered_time=10.0)) as producer:
            await ready(producer)
            pending = await producer.submit(STREAM, b"x", partition_key="k", explicit_hash_key=0)
            await producer.flush()
            assert (await pending).success
            assert anyio.current_time() == 0.0
            stream = producer.statistics().streams[STREAM]
            # (the warm-up record may have made shard 3's limiter too)
            assert "shardId-000000000000" in stream.rates
            assert set(stream.token_levels) == set(stream.rates)

    async def test_a_record_waiting_for_a_failing_shard_map_expires_at_its_ttl_unsent(
        self,
    ) -> None:
        fake = FakeKinesis()
        fake.list_shards_errors = [client_error("InternalFailure", 500)] * 1000
        options = fast(record_ttl=1.0, record_max_buffered_time=2.0)
        async with Producer(transport=fake, **options) as producer:
            start = anyio.current_time()
            with pytest.raises(errors.RecordFailedError) as info:
                await producer.put_record(STREAM, b"x", partition_key="k")
            # at its TTL (within the Limiter's scan interval), not at the wait's end
            assert 1.0 <= anyio.current_time() - start <= 1.0 + EXPIRY_SCAN_INTERVAL
            (attempt,) = info.value.result.attempts
            assert attempt.error_code == errors.EXPIRED
            assert attempt.error_message is not None
            assert "ListShards failed: InternalFailure" in attempt.error_message
            assert fake.requests == []  # never sent
            # the map comes (at ListShards' next try): records are delivered again
            fake.list_shards_errors = []
            await anyio.sleep(60.0)
            start = anyio.current_time()
            assert (await producer.put_record(STREAM, b"y", partition_key="k")).success
            # at once: the stream is idle (no answer had to come to say so), it does not wait
            # out record_max_buffered_time
            assert anyio.current_time() - start < 1.0
        assert [len(r) for r in fake.requests] == [1]

    @pytest.mark.timeout(15)
    async def test_aggregation_off_is_still_rate_limited(self) -> None:
        fake = FakeKinesis()
        async with Producer(
            transport=fake, aggregation_enabled=False, rate_limit=1.0, **FAST
        ) as producer:
            await ready(producer)  # on the last shard
            start = anyio.current_time()
            pendings = [
                await producer.submit(STREAM, b"%d" % i, partition_key="p", explicit_hash_key=0)
                for i in range(30)
            ]
            with anyio.fail_after(60):
                for p in pendings:
                    await p
            elapsed = anyio.current_time() - start
        # 10 records/s on the shard, a bucket of 10: 10 at once, then 20 more over 2 s
        assert 1.9 <= elapsed <= 4.0
        assert stored(fake) == Counter(b"%d" % i for i in range(30))
        shard_0 = fake.shards[0]
        assert len(shard_0.records) == 30  # one Kinesis record each

    @pytest.mark.timeout(15)
    async def test_overload_waits_at_the_call_instead_of_expiring(self) -> None:
        """10 records/s on the shard and a 0.5 s TTL: the stream may hold a quarter of a
        second of its delivery (max_outstanding_time defaults to half the TTL), so submit
        waits for room and every admitted record is delivered."""
        fake = FakeKinesis()
        async with _ten_records_a_second(fake) as producer:
            await ready(producer)
            start = anyio.current_time()
            pendings = [
                await producer.submit(STREAM, b"%d" % i, partition_key="p", explicit_hash_key=0)
                for i in range(30)
            ]
            stats = producer.statistics().streams[STREAM]
            assert stats.outstanding_records <= 3
            with anyio.fail_after(60):
                await producer.flush()
            elapsed = anyio.current_time() - start
        assert all(p.result().success for p in pendings)
        assert len(stored(fake)) == 30
        assert elapsed >= 2.0  # 30 records at 10/s (less the bucket's first 5)

    @pytest.mark.timeout(15)
    async def test_overload_past_admission_timeout_raises_backpressure_timeout(self) -> None:
        fake = FakeKinesis()
        async with _ten_records_a_second(fake, admission_timeout=0.05) as producer:
            await ready(producer)
            outcomes = []
            for i in range(30):
                try:
                    await producer.submit(STREAM, b"%d" % i, partition_key="p")
                except errors.BackpressureTimeout as exc:
                    outcomes.append(str(exc))
            await producer.flush()
        assert outcomes
        assert "max_outstanding_time=0.25 s" in outcomes[0]

    @pytest.mark.timeout(15)
    async def test_records_expire_in_the_limiter(self) -> None:
        fake = FakeKinesis()
        # max_outstanding_time off: admit more than the shard can send in time
        async with _ten_records_a_second(fake, max_outstanding_time=math.inf) as producer:
            await ready(producer)
            pendings = [
                await producer.submit(STREAM, b"%d" % i, partition_key="p", explicit_hash_key=0)
                for i in range(30)
            ]
            with anyio.fail_after(60):
                await producer.flush()
        failures: list[tuple[str | None, str | None]] = []
        for p in pendings:
            try:
                p.result()
            except errors.RecordFailedError as exc:
                failures.append((exc.error_code, exc.result.attempts[-1].error_message))
        ok = len(pendings) - len(failures)
        # 5 at once (half a second of tokens), then 10/s for the ~0.5 s TTL: about 10
        assert 7 <= ok <= 13
        assert {code for code, _ in failures} == {errors.EXPIRED}
        assert all("limiter" in str(message) for _, message in failures)
        assert len(stored(fake)) == ok

    @pytest.mark.timeout(15)
    async def test_throttled_records_back_off_exponentially(self) -> None:
        fake = FakeKinesis()
        times: list[float] = []

        def throttle_five_times(shard_id: str, index: int) -> tuple[str, str] | None:
            times.append(anyio.current_time())
            return (THROTTLED, "slow down") if len(times) <= 5 else None

        async with Producer(
            transport=fake,
            record_max_buffered_time=0.0,
            retry_backoff_initial=0.1,
            retry_backoff_max=0.4,
        ) as producer:
            await ready(producer)
            fake.entry_error = throttle_five_times
            result = await producer.put_record(STREAM, b"x", partition_key="k")
        assert result.success
        assert len(result.attempts) == 6
        gaps = [b - a for a, b in itertools.pairwise(times)]
        caps = [0.1, 0.2, 0.4, 0.4, 0.4]
        for gap, cap in zip(gaps, caps, strict=True):
            assert 0.0 <= gap <= cap + 0.01
        assert sum(a.delay for a in result.attempts[1:]) <= sum(caps) + 0.05


# -- adaptive rate control through the public API ---------------------------------------------


@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive", "static"])
async def test_statistics_show_each_shards_rate_cuts_throttles_and_waits(
    fake_kinesis: FakeKinesis, adaptive: bool
) -> None:
    throttled_once: set[str] = set()

    def throttle_shard_0_once(shard_id: str, index: int) -> tuple[str, str] | None:
        if shard_id == "shardId-000000000000" and shard_id not in throttled_once:
            throttled_once.add(shard_id)
            return (THROTTLED, "Rate exceeded for shard")
        return None

    # aggregation off: a round needs a few Kinesis records of the shard before it cuts
    options = {**FAST, "aggregation_enabled": False}
    async with Producer(transport=fake_kinesis, adaptive=adaptive, **options) as producer:
        await ready(producer)
        fake_kinesis.entry_error = throttle_shard_0_once
        pendings = [
            await producer.submit(STREAM, b"x" * 100, partition_key=f"pk-{i}") for i in range(200)
        ]
        with anyio.fail_after(20):
            results = [await p for p in pendings]
        shards = producer.statistics().streams[STREAM].shards
    assert all(r.success for r in results)
    throttled = shards["shardId-000000000000"]
    assert throttled.throttled_records == 1
    assert throttled.ceiling == (1000.0, 1024 * 1024.0)
    assert throttled.backoff > 0
    assert throttled.records_sent >= 2
    assert sum(s.bytes_sent for s in shards.values()) >= 200 * 100
    if adaptive:
        assert throttled.cuts == 1
        assert throttled.rate[0] < throttled.ceiling[0]
    else:
        assert throttled.cuts == 0
        assert throttled.rate == throttled.ceiling
    for shard_id, shard in shards.items():
        if shard_id != "shardId-000000000000":
            assert shard.cuts == 0
            assert shard.throttled_records == 0
            assert shard.rate == shard.ceiling
        assert shard.queued == 0
        assert shard.token_wait >= 0.0


async def test_fleet_demand_counts_kinesis_records_as_the_grants_do(
    fake_kinesis: FakeKinesis,
) -> None:
    """Grants cap Kinesis records (an aggregate is one): the demand a fleet worker reports is
    in the same units, not in user records."""
    async with Producer(transport=fake_kinesis, **FAST) as producer:
        await ready(producer)
        for i in range(400):
            await producer.submit(STREAM, b"x" * 50, partition_key=f"pk-{i}")
        await producer.flush()
        demand = producer._fleet_demand()
    assert demand.admitted_records <= 40  # aggregates, not 400 user records
    assert demand.admitted_bytes >= 400 * 50
    assert demand.backlog_records == 0
    assert demand.backlog_bytes == 0


# -- explicit hash keys too long to convert -------------------------------------------------
# Python refuses to convert a str of more than 4,300 digits to an int, or such an int to a str
# (sys.get_int_max_str_digits): these keys once raised a bare ValueError from the check itself.


@pytest.mark.parametrize(
    ("key", "fragment"),
    [
        pytest.param("9" * 5000, "a decimal integer of 5000 digits", id="str-5000-digits"),
        pytest.param("1" + "0" * 39, "a decimal integer of 40 digits", id="str-10**39"),
        pytest.param(10**5000, "an integer of 16610 bits", id="int-10**5000"),
        pytest.param(-(10**5000), "a negative integer of 16610 bits", id="int-minus-10**5000"),
        pytest.param("x" * 5000, "'xxxxxxxxxx", id="str-5000-letters"),
    ],
)
@pytest.mark.parametrize("method", ["submit", "put_record"])
async def test_explicit_hash_keys_too_long_to_convert_are_invalid_record_errors(
    fake_kinesis: FakeKinesis, key: str | int, fragment: str, method: str
) -> None:
    async with Producer(transport=fake_kinesis, **FAST) as producer:
        with pytest.raises(errors.InvalidRecordError) as info:
            await getattr(producer, method)(STREAM, b"x", partition_key="k", explicit_hash_key=key)
        message = str(info.value)
        assert message.startswith("explicit_hash_key must be ")
        assert fragment in message
        assert len(message) < 200
        assert producer.outstanding_records == 0
        await producer.flush()
    assert fake_kinesis.requests == []


async def test_a_long_explicit_hash_key_of_leading_zeros_is_sent_without_them(
    fake_kinesis: FakeKinesis,
) -> None:
    # Kinesis takes ExplicitHashKey as 0|[1-9][0-9]{0,38}: the key goes out as its number.
    keys = ["0" * 5000 + str(MAX_HASH), "0" * 5000, "0" * 4999 + "1"]
    async with Producer(transport=fake_kinesis, aggregation_enabled=False, **FAST) as producer:
        results = [
            await producer.put_record(STREAM, b"%d" % i, partition_key="k", explicit_hash_key=key)
            for i, key in enumerate(keys)
        ]
    sent = [entry["ExplicitHashKey"] for request in fake_kinesis.requests for entry in request]
    assert sorted(sent) == sorted([str(MAX_HASH), "0", "1"])
    for result, number in zip(results, [MAX_HASH, 0, 1], strict=True):
        lo, hi = range_of(fake_kinesis, str(result.shard_id))
        assert lo <= number <= hi


# -- submit's admission without a wait --------------------------------------------------------


async def test_a_loop_of_submits_that_never_waits_still_lets_others_run(
    fake_kinesis: FakeKinesis,
) -> None:
    # submit admits with room at once and yields to the event loop every CHECKPOINT_EVERY
    # admissions: other tasks (the stages, here a counter) run meanwhile, and a cancellation
    # gets in, with every record admitted before it still delivered
    async with Producer(transport=fake_kinesis, **FAST) as producer:
        await producer.put_record(STREAM, b"warm", partition_key="w")  # shard map ready
        ticks = 0
        admitted: list[PendingRecord] = []

        async def counter() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            tg.start_soon(counter)
            await anyio.lowlevel.checkpoint()
            ticks = 0
            for i in range(10 * CHECKPOINT_EVERY):
                admitted.append(await producer.submit(STREAM, b"r%d" % i, partition_key="k"))
            # about once per CHECKPOINT_EVERY submits (10 here); trio's scheduler may run a
            # task twice in a row, so give or take a few (without the checkpoints: 0)
            assert 5 <= ticks <= 20
            with anyio.CancelScope() as scope:
                scope.cancel()  # pending: delivered at the next checkpoint
                for i in range(2 * CHECKPOINT_EVERY):
                    admitted.append(await producer.submit(STREAM, b"c%d" % i, partition_key="k"))
            assert scope.cancelled_caught
            tg.cancel_scope.cancel()
        assert len(admitted) < 12 * CHECKPOINT_EVERY  # the cancellation cut the second loop
        results = [await pending for pending in admitted]
    assert all(result.success for result in results)
    stored = {r.data for r in fake_kinesis.user_records()}
    assert {pending.data for pending in admitted} <= stored


# -- submit_many ------------------------------------------------------------------------------


async def test_submit_many_admits_every_record_in_order(fake_kinesis: FakeKinesis) -> None:
    async with Producer(transport=fake_kinesis, **FAST) as producer:
        handles = await producer.submit_many(
            STREAM,
            [b"bare", (b"keyed", "k1"), (b"hashed", "k2", MAX_HASH), (bytearray(b"ba"),)],
        )
        assert len(handles) == 4
        assert producer.outstanding_records == 4
        results = [await handle for handle in handles]
    assert all(result.success for result in results)
    stored = {r.data: r for r in fake_kinesis.user_records()}
    assert stored[b"keyed"].partition_key == "k1"
    # the explicit hash key placed it: the last shard's range ends at MAX_HASH
    assert stored[b"hashed"].shard_id == fake_kinesis.shards[-1].shard_id
    assert set(stored) == {b"bare", b"keyed", b"hashed", b"ba"}
    assert [h.data for h in handles] == [b"bare", b"keyed", b"hashed", b"ba"]


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ("text", errors.RecordTypeError),
        ((b"x", ""), errors.InvalidRecordError),
        ((b"x", "k", "not-a-number"), errors.InvalidRecordError),
        ((b"x", "k", None, "extra"), errors.RecordTypeError),
        (42, errors.RecordTypeError),
    ],
)
async def test_submit_many_validates_everything_first(
    fake_kinesis: FakeKinesis, bad: object, error: type[Exception]
) -> None:
    async with Producer(transport=fake_kinesis, **FAST) as producer:
        records = [(b"a", "k"), (b"b", "k"), (b"c", "k"), bad]
        with pytest.raises(error, match=r"^records\[3\]: "):
            await producer.submit_many(STREAM, records)  # type: ignore[arg-type]
        assert producer.outstanding_records == 0
    assert fake_kinesis.user_records() == []


async def test_submit_many_waits_for_room_and_reports_what_it_admitted() -> None:
    fake = GatedKinesis(SPREAD_SHARDS)
    async with Producer(
        transport=fake, max_outstanding_records=10, admission_timeout=0.1, **FAST
    ) as producer:
        await ready(producer)
        fake.close_gate()
        records = [(b"%d" % i, "k", spread(i)) for i in range(15)]
        with pytest.raises(errors.BackpressureTimeout) as caught:
            await producer.submit_many(STREAM, records)
        admitted = caught.value.admitted
        assert [h.data for h in admitted] == [b"%d" % i for i in range(10)]
        assert producer.outstanding_records == 10
        assert fake.gate is not None
        fake.gate.set()
        await producer.flush()
        assert all(h.result().success for h in admitted)
    assert stored(fake) == Counter(b"%d" % i for i in range(10))


@pytest.mark.autojump
async def test_requests_go_full_while_every_connection_is_busy(fake_kinesis: FakeKinesis) -> None:
    # One connection, 20 records a request, 40 ms per request (500 records/s) behind a shard
    # that releases 1,000 records/s: the records waiting for the connection are past their
    # deadline, and were cut into part-full requests at each release; now a due request is
    # held while another waits for the Sender.
    async with Producer(
        transport=fake_kinesis,
        max_connections=1,
        collection_max_count=20,
        aggregation_enabled=False,
        **FAST,
    ) as producer:
        await ready(producer)
        fake_kinesis.requests.clear()
        fake_kinesis.delay = 0.04
        handles = [await producer.submit(STREAM, b"%d" % i, "k", spread(0)) for i in range(2000)]
        for handle in handles:
            await handle
    sizes = [len(request) for request in fake_kinesis.requests]
    assert sum(sizes) == 2000
    assert sum(size == 20 for size in sizes) >= len(sizes) - 2, sizes


async def test_submit_many_reports_what_it_admitted_when_the_producer_begins_closing() -> None:
    fake = GatedKinesis(SPREAD_SHARDS)
    caught: list[errors.ProducerClosedError] = []
    async with Producer(transport=fake, max_outstanding_records=4, **FAST) as producer:
        await ready(producer)
        fake.close_gate()

        async def batch() -> None:
            with pytest.raises(errors.ProducerClosedError) as error:
                await producer.submit_many(STREAM, [(b"%d" % i, "k", spread(i)) for i in range(6)])
            caught.append(error.value)

        async with anyio.create_task_group() as group:
            group.start_soon(batch)
            await wait_until(lambda: producer.outstanding_records == 4)  # the 5th waits
            group.start_soon(producer.aclose)  # it ends the wait, then flushes
            await wait_until(lambda: bool(caught))
            assert fake.gate is not None
            fake.gate.set()
    (error,) = caught
    assert "4 of the batch's 6 records were admitted" in str(error), error
    assert [h.data for h in error.admitted] == [b"0", b"1", b"2", b"3"]
    assert all(h.result().success for h in error.admitted)
    assert stored(fake) == Counter(b"%d" % i for i in range(4))


async def test_submit_many_reports_what_it_admitted_when_the_spool_refuses_a_record(
    fake_kinesis: FakeKinesis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    appended: list[bytes] = []
    real_append = Spool.append

    def append_three(spool: Spool, record: PendingRecord) -> None:
        if len(appended) == 3:
            raise errors.SpoolError("the disk is full (test)")
        real_append(spool, record)
        appended.append(record.data)

    monkeypatch.setattr(Spool, "append", append_three)
    async with Producer(transport=fake_kinesis, spool_dir=str(tmp_path), **FAST) as producer:
        await ready(producer)
        appended.clear()  # the warm-up record
        with pytest.raises(errors.SpoolError, match="disk is full") as caught:
            await producer.submit_many(STREAM, [(b"%d" % i, "k") for i in range(6)])
        admitted = caught.value.admitted
        assert [h.data for h in admitted] == [b"0", b"1", b"2"] == appended
        assert producer.outstanding_records == 3
        await producer.flush()
        assert all(h.result().success for h in admitted)
    assert sorted(r.data for r in fake_kinesis.user_records()) == [b"0", b"1", b"2", b"warmup"]


@pytest.mark.parametrize(
    ("stream", "error", "message"),
    [
        (b"stream", errors.RecordTypeError, "^stream must be a str, not bytes$"),
        ("bad name!", errors.InvalidRecordError, "stream"),
    ],
)
async def test_submit_many_names_a_bad_stream_not_a_record(
    fake_kinesis: FakeKinesis, stream: object, error: type[Exception], message: str
) -> None:
    async with Producer(transport=fake_kinesis, **FAST) as producer:
        for records in ([(b"a", "k")], []):
            with pytest.raises(error, match=message):
                await producer.submit_many(stream, records)  # type: ignore[arg-type]
        assert producer.outstanding_records == 0


async def test_submit_many_of_nothing(fake_kinesis: FakeKinesis) -> None:
    async with Producer(transport=fake_kinesis, **FAST) as producer:
        for records in ([], iter(())):
            batch = await producer.submit_many(STREAM, records)
            assert list(batch) == []
            assert batch.done()
            assert await batch == BatchResult(succeeded=0, failed=0, failures=())


async def test_submit_many_batch_handle_counts_and_reports_failures(
    fake_kinesis: FakeKinesis,
) -> None:
    """A batch whose records go to two shards, one of which refuses them for good: the
    batch's own handle counts both kinds, and its result names each failure by position."""
    first_shard = fake_kinesis.shards[0].shard_id
    fake_kinesis.entry_error = lambda shard, index: (
        ("KMSAccessDeniedException", "no key") if shard == first_shard else None
    )
    doomed = {1, 4}  # explicit hash key 0 is the first shard's; MAX_HASH the last shard's
    records = [(b"%d" % i, "k", 0 if i in doomed else MAX_HASH) for i in range(6)]
    async with Producer(transport=fake_kinesis, record_ttl=30.0, **FAST) as producer:
        await ready(producer)
        with anyio.fail_after(5):
            batch = await producer.submit_many(STREAM, records)
            assert isinstance(batch, PendingBatch)
            assert len(batch) == 6
            assert [p.data for p in batch] == [b"%d" % i for i in range(6)]
            assert [p.data for p in batch[4:]] == [b"4", b"5"]
            outcome = await batch
    assert batch.done()
    assert (batch.succeeded, batch.failed) == (4, 2)
    assert (outcome.succeeded, outcome.failed) == (4, 2)
    assert [position for position, _ in outcome.failures] == [1, 4]
    for position, result in outcome.failures:
        assert not result.success
        assert result.attempts[-1].error_code == "KMSAccessDeniedException"
        with pytest.raises(errors.RecordFailedError):
            batch[position].result()
    assert all(batch[i].result().success for i in range(6) if i not in doomed)
    assert batch.result() == outcome
    assert repr(batch) == "<PendingBatch 6 record(s): 4 succeeded, 2 failed, 0 pending>"
    assert sorted(r.data for r in fake_kinesis.user_records()) == [
        b"0",
        b"2",
        b"3",
        b"5",
        b"warmup",
    ]


async def test_submit_many_batch_is_pending_until_its_last_record_is_done() -> None:
    fake = GatedKinesis()
    async with Producer(transport=fake, **FAST) as producer:
        await ready(producer)
        fake.close_gate()
        batch = await producer.submit_many(STREAM, [(b"a", "k"), (b"b", "k")])
        assert not batch.done()
        assert (batch.succeeded, batch.failed) == (0, 0)
        with pytest.raises(RuntimeError, match="2 record"):
            batch.result()
        with anyio.move_on_after(0.05) as scope:
            await batch  # cancelling the wait leaves the records alone
        assert scope.cancelled_caught
        assert fake.gate is not None
        fake.gate.set()
        with anyio.fail_after(5):
            assert await batch.wait() == BatchResult(succeeded=2, failed=0, failures=())
    assert stored(fake) == Counter([b"a", b"b"])


async def test_submit_many_batch_of_records_failed_at_close() -> None:
    """Records that are failed by the producer's close count in their batch too, so an
    awaiter of the batch never hangs."""
    fake = GatedKinesis()
    with anyio.fail_after(5):
        async with (
            anyio.create_task_group() as tg,
            Producer(transport=fake, **{**FAST, "close_timeout": 0.1}) as producer,
        ):
            await ready(producer)
            fake.close_gate()
            batch = await producer.submit_many(STREAM, [(b"a", "k"), (b"b", "k")])
            outcomes: list[BatchResult] = []

            async def wait_for_it() -> None:
                outcomes.append(await batch)

            tg.start_soon(wait_for_it)
    assert [(o.succeeded, o.failed) for o in outcomes] == [(0, 2)]
    assert [p for p, _ in outcomes[0].failures] == [0, 1]


async def test_submit_many_after_close_is_refused(fake_kinesis: FakeKinesis) -> None:
    async with Producer(transport=fake_kinesis, **FAST) as producer:
        pass
    with pytest.raises(errors.ProducerClosedError):
        await producer.submit_many(STREAM, [b"x"])


async def test_submit_nowait_admits_what_fits_and_never_waits() -> None:
    fake = GatedKinesis(SPREAD_SHARDS)
    async with Producer(transport=fake, max_outstanding_records=4, **FAST) as producer:
        with pytest.raises(errors.InvalidRecordError):
            producer.submit_nowait(STREAM, b"x", partition_key="")  # bad input: at the call
        await ready(producer)
        fake.close_gate()
        admitted = [
            producer.submit_nowait(
                STREAM, b"%d" % i, partition_key="k", explicit_hash_key=spread(i)
            )
            for i in range(4)
        ]
        with pytest.raises(anyio.WouldBlock):  # the producer's cap: nothing enqueued
            producer.submit_nowait(STREAM, b"4", partition_key="k", explicit_hash_key=spread(4))
        assert producer.outstanding_records == 4
        assert fake.gate is not None
        fake.gate.set()
        await producer.flush()
        assert all([(await pending).success for pending in admitted])
        assert producer.submit_nowait(STREAM, b"5", partition_key="k").done() is False
    with pytest.raises(errors.ProducerClosedError):
        producer.submit_nowait(STREAM, b"6", partition_key="k")
    assert stored(fake) == Counter(b"%d" % i for i in (0, 1, 2, 3, 5))


async def test_submit_nowait_on_a_hot_shard_would_block_while_other_shards_take_records() -> None:
    fake = GatedKinesis()
    async with Producer(transport=fake, max_outstanding_records=8, **FAST) as producer:
        await ready(producer)
        fake.close_gate()
        # the last record of the cap (RESERVE, at least one) is kept for a quiet shard
        for _ in range(7):
            producer.submit_nowait(STREAM, b"h", partition_key="h", explicit_hash_key=0)
        with pytest.raises(anyio.WouldBlock):
            producer.submit_nowait(STREAM, b"h", partition_key="h", explicit_hash_key=0)
        cold = producer.submit_nowait(STREAM, b"c", partition_key="c", explicit_hash_key=MAX_HASH)
        shards = producer.statistics().streams[STREAM].shards
        first, last = fake.shards[0].shard_id, fake.shards[-1].shard_id
        assert (shards[first].outstanding_records, shards[last].outstanding_records) == (7, 1)
        assert fake.gate is not None
        fake.gate.set()
        await producer.flush()
        assert (await cold).success
