"""End to end against moto's server: put through the public API, read the stream back.

"Nothing lost" is judged from the stream itself: every test that puts records reads
every shard back with GetRecords, deaggregates, and checks what arrived — each user record
exactly once, with its partition key and data, in the shard whose hash key range holds its hash
key (docs/wire.md) — not by counting callbacks. Every test runs on asyncio and on trio.

GetRecords does not return a record's explicit hash key, so a user record's hash key is taken
from the aggregate's EHK table when it is there, from the MD5 of its partition key otherwise,
and, for a record sent raw with an EHK of its own, from what the test sent.
"""

from __future__ import annotations

import base64
import gc
import hashlib
import random
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from aws_kinesis_agg import deaggregator

from anykpl import PendingBatch, PendingRecord, Producer, ProducerConfig, RecordResult, errors
from anykpl._core._limits import MAX_HASH_KEY
from anykpl._core._records import RESOLVED_YIELD_EVERY
from anykpl._core._wire import MAGIC, DecodedRecord, deaggregate

pytestmark = pytest.mark.anyio
AGGREGATION_MAX_SIZE = 51200  # the default, stated here so the oversized records stay oversized


# -- what was sent ------------------------------------------------------------------------


@dataclass(frozen=True)
class Sent:
    uid: int
    partition_key: str
    explicit_hash_key: str | None
    data: bytes

    @property
    def hash_key(self) -> int:
        if self.explicit_hash_key is not None:
            return int(self.explicit_hash_key)
        return md5_hash_key(self.partition_key)


def md5_hash_key(partition_key: str) -> int:
    return int.from_bytes(hashlib.md5(partition_key.encode()).digest(), "big")


#: every byte to a lower-case letter (``payload``)
_LETTERS = bytes(97 + byte % 26 for byte in range(256))


def payload(uid: int, size: int = 100) -> bytes:
    """``size`` bytes that start with the record's unique id: ``b"000042|xxxx..."``. The
    letters come from ``random.randbytes`` in one call: a ``randrange`` per byte took about
    a millisecond for a 2,000-byte record, as much CPU as the producer it was feeding, which
    kept tests that offer a stream its capacity from reaching it on a slow machine."""
    head = f"{uid:07d}|".encode()
    return head + random.randbytes(max(0, size - len(head))).translate(_LETTERS)


def uid_of(data: bytes) -> int:
    return int(data.split(b"|", 1)[0])


def make_sent(
    uid: int, partition_key: str, *, size: int = 100, explicit_hash_key: str | None = None
) -> Sent:
    return Sent(uid, partition_key, explicit_hash_key, payload(uid, size))


def sent_with_hash_keys(
    count: int, prefix: str, *, keys: int, every: int, seed: int
) -> dict[int, Sent]:
    """``count`` records under ``keys`` partition keys (``prefix-N``), every ``every``-th with
    an explicit hash key of its own (random, from ``seed``)."""
    rng = random.Random(seed)
    return {
        uid: make_sent(
            uid,
            f"{prefix}-{uid % keys}",
            explicit_hash_key=str(rng.randint(0, MAX_HASH_KEY)) if uid % every == 0 else None,
        )
        for uid in range(count)
    }


# -- reading the stream back --------------------------------------------------------------


@dataclass(frozen=True)
class UserRecord:
    """One user record as a consumer sees it."""

    shard_id: str
    sequence_number: str
    sub_sequence_number: int
    aggregated: bool
    decoded: DecodedRecord


@dataclass
class StreamContents:
    ranges: dict[str, tuple[int, int]]
    kinesis_records: dict[str, list[dict[str, Any]]]  # shard id -> GetRecords records

    def user_records(self) -> Iterator[UserRecord]:
        for shard_id, records in self.kinesis_records.items():
            for record in records:
                decoded = deaggregate(
                    record["Data"], record["PartitionKey"], record.get("ExplicitHashKey")
                )
                aggregated = bytes(record["Data"][:4]) == MAGIC and len(decoded) > 1
                for index, user_record in enumerate(decoded):
                    yield UserRecord(
                        shard_id, record["SequenceNumber"], index, aggregated, user_record
                    )


def read_stream(client: Any, stream: str) -> StreamContents:
    """Every Kinesis record of every shard, from TRIM_HORIZON to the end."""
    shards = client.list_shards(StreamName=stream)["Shards"]
    ranges = {
        s["ShardId"]: (
            int(s["HashKeyRange"]["StartingHashKey"]),
            int(s["HashKeyRange"]["EndingHashKey"]),
        )
        for s in shards
    }
    contents: dict[str, list[dict[str, Any]]] = {}
    for shard_id in ranges:
        iterator = client.get_shard_iterator(
            StreamName=stream, ShardId=shard_id, ShardIteratorType="TRIM_HORIZON"
        )["ShardIterator"]
        records: list[dict[str, Any]] = []
        while iterator:
            response = client.get_records(ShardIterator=iterator, Limit=10000)
            if not response["Records"]:
                break
            records.extend(response["Records"])
            iterator = response.get("NextShardIterator")
        contents[shard_id] = records
    return StreamContents(ranges, contents)


async def read_stream_async(client: Any, stream: str) -> StreamContents:
    return await anyio.to_thread.run_sync(partial(read_stream, client, stream))


def check_read_back(contents: StreamContents, sent: dict[int, Sent]) -> Counter[int]:
    """Check every user record read back against what was sent (keys, data, EHK, shard) and
    return how many times each unique id arrived."""
    arrived: Counter[int] = Counter()
    for user_record in contents.user_records():
        decoded = user_record.decoded
        uid = uid_of(decoded.data)
        assert uid in sent, f"read back a record that was never sent: {decoded!r}"
        original = sent[uid]
        assert decoded.partition_key == original.partition_key
        assert decoded.data == original.data
        if user_record.aggregated:
            # inside an aggregate the EHK table says which records had one
            assert decoded.explicit_hash_key == original.explicit_hash_key
            hash_key = (
                int(decoded.explicit_hash_key)
                if decoded.explicit_hash_key is not None
                else md5_hash_key(decoded.partition_key)
            )
        else:
            # a raw record's EHK is not returned by GetRecords
            hash_key = original.hash_key
        start, end = contents.ranges[user_record.shard_id]
        assert start <= hash_key <= end, (
            f"user record {uid} (hash key {hash_key}) is in {user_record.shard_id}, "
            f"whose range is [{start}, {end}]"
        )
        arrived[uid] += 1
    return arrived


def assert_success(result: RecordResult) -> None:
    assert result.success
    assert result.shard_id is not None
    assert result.shard_id.startswith("shardId-")
    assert result.sequence_number is not None
    assert result.sub_sequence_number is not None
    assert result.attempts
    assert result.attempts[-1].success
    assert result.attempts[-1].error_code is None


def final_result(handle: PendingRecord) -> RecordResult:
    """A done record's result, whether it succeeded or failed."""
    try:
        return handle.result()
    except errors.RecordFailedError as exc:
        return exc.result


async def wait_for_shard_map(producer: Producer, stream: str) -> None:
    """Put one record so the stream's pipeline exists, then wait until its shard map is
    READY, so later records are aggregated."""
    await producer.put_record(stream, payload(9_999_999), partition_key="warm-up")
    for _ in range(1000):
        if producer.statistics().streams[stream].shard_map_state == "READY":
            return
        await anyio.sleep(0.01)
    raise AssertionError("the shard map did not become READY within 10 s")


# -- 1. the headline ----------------------------------------------------------------------


@pytest.mark.timeout(120)
async def test_many_concurrent_records_all_arrive_once_in_the_right_shard(
    make_stream: Any, kinesis_client: Any, producer_options: dict[str, Any]
) -> None:
    stream = make_stream(4)
    rng = random.Random(20240601)
    keys = [f"device-{i:04d}" for i in range(2000)]
    sent: dict[int, Sent] = {}
    total = 20_000
    oversized = set(rng.sample(range(total), 20))
    for uid in range(total):
        explicit_hash_key = str(rng.randint(0, MAX_HASH_KEY)) if rng.random() < 0.05 else None
        size = 60_000 if uid in oversized else rng.randint(90, 110)
        sent[uid] = make_sent(
            uid, keys[uid % len(keys)], size=size, explicit_hash_key=explicit_hash_key
        )
    assert sum(s.explicit_hash_key is not None for s in sent.values()) > 500
    assert all(len(sent[uid].data) > AGGREGATION_MAX_SIZE for uid in oversized)

    workers = 50
    uids = list(sent)
    rng.shuffle(uids)
    shares = [uids[w::workers] for w in range(workers)]
    pending: dict[int, PendingRecord] = {}
    results: dict[int, RecordResult] = {}

    started = anyio.current_time()
    async with Producer(aggregation_max_size=AGGREGATION_MAX_SIZE, **producer_options) as producer:

        async def worker(share: list[int]) -> None:
            for n, uid in enumerate(share):
                record = sent[uid]
                if n % 50 == 0:
                    results[uid] = await producer.put_record(
                        stream, record.data, record.partition_key, record.explicit_hash_key
                    )
                else:
                    pending[uid] = await producer.submit(
                        stream, record.data, record.partition_key, record.explicit_hash_key
                    )

        async with anyio.create_task_group() as tg:
            for share in shares:
                tg.start_soon(worker, share)
        await producer.flush()
        assert all(p.done() for p in pending.values())
        for uid, p in pending.items():
            results[uid] = await p
    put_seconds = anyio.current_time() - started

    assert len(results) == total
    for result in results.values():
        assert_success(result)

    contents = await read_stream_async(kinesis_client, stream)
    arrived = check_read_back(contents, sent)
    missing = set(sent) - set(arrived)
    duplicated = {uid: n for uid, n in arrived.items() if n > 1}
    assert not missing, f"{len(missing)} records lost, e.g. {sorted(missing)[:10]}"
    assert not duplicated, f"{len(duplicated)} records duplicated, e.g. {duplicated}"
    read_back = Counter((u.decoded.partition_key, u.decoded.data) for u in contents.user_records())
    assert read_back == Counter((s.partition_key, s.data) for s in sent.values())

    # each result names the shard the record really landed in
    where = {
        uid_of(u.decoded.data): (u.shard_id, u.sequence_number) for u in contents.user_records()
    }
    for uid, result in results.items():
        assert (result.shard_id, result.sequence_number) == where[uid]

    # aggregation did happen, and the oversized records went out raw
    kinesis_count = sum(len(r) for r in contents.kinesis_records.values())
    assert kinesis_count < total // 10
    raw = {uid_of(u.decoded.data) for u in contents.user_records() if not u.aggregated}
    assert oversized <= raw

    # AWS's own deaggregator reads every record the same way
    checked = 0
    for records in contents.kinesis_records.values():
        for record in records:
            ours = deaggregate(record["Data"], record["PartitionKey"])
            theirs = deaggregator.deaggregate_records(
                [
                    {
                        "kinesis": {
                            "kinesisSchemaVersion": "1.0",
                            "sequenceNumber": record["SequenceNumber"],
                            "approximateArrivalTimestamp": 0,
                            "partitionKey": record["PartitionKey"],
                            "data": base64.b64encode(record["Data"]),
                        }
                    }
                ]
            )
            assert len(theirs) == len(ours)
            for index, (mine, other) in enumerate(zip(ours, theirs, strict=True)):
                assert base64.b64decode(other["kinesis"]["data"]) == mine.data
                assert other["kinesis"]["partitionKey"] == mine.partition_key
                if len(ours) > 1:
                    assert other["kinesis"]["subSequenceNumber"] == index
                if mine.explicit_hash_key is not None:
                    # (the reference deaggregator reports the EHK table's entry 0 for records
                    # without an EHK index, so only records that have one are compared)
                    assert other["kinesis"]["explicitHashKey"] == mine.explicit_hash_key
                checked += 1
    assert checked == total
    assert put_seconds < 30, f"putting took {put_seconds:.1f} s"


# -- 2. result details --------------------------------------------------------------------


async def test_result_sub_sequence_numbers_match_the_aggregate_read_back(
    make_stream: Any, kinesis_client: Any, producer_options: dict[str, Any]
) -> None:
    stream = make_stream(2)
    sent = {uid: make_sent(uid, "same-key") for uid in range(5)}
    async with Producer(**producer_options) as producer:
        await wait_for_shard_map(producer, stream)
        submitted = anyio.current_time()
        handles = [
            await producer.submit(stream, s.data, partition_key=s.partition_key)
            for s in sent.values()
        ]
        await producer.flush()
        results = [await handle for handle in handles]
        alone = payload(5)
        called = anyio.current_time()
        single = await producer.put_record(stream, alone, partition_key="alone")
        returned = anyio.current_time()

    # the attempts' delays and durations (the producer's clock is anyio's) lie inside the time
    # the test saw each record in the producer; a lone put on an idle stream goes at once
    # (adaptive batching), not after record_max_buffered_time
    for result, inside in [
        *((r, called - submitted) for r in results),
        (single, returned - called),
    ]:
        assert_success(result)
        assert sum(a.delay + a.duration for a in result.attempts) <= inside
        assert all(a.duration > 0 for a in result.attempts)
    buffered = ProducerConfig(**producer_options).record_max_buffered_time
    assert single.attempts[0].delay < buffered / 2
    assert len({r.sequence_number for r in results}) == 1
    assert len({r.shard_id for r in results}) == 1
    assert [r.sub_sequence_number for r in results] == [0, 1, 2, 3, 4]
    assert single.sub_sequence_number == 0

    contents = await read_stream_async(kinesis_client, stream)
    # (moto numbers each shard's records on their own, so a sequence number needs its shard)
    by_sequence = {
        (shard, r["SequenceNumber"]): r
        for shard, records in contents.kinesis_records.items()
        for r in records
    }
    record = by_sequence[results[0].shard_id, results[0].sequence_number]
    assert record["Data"][:4] == MAGIC
    decoded = deaggregate(record["Data"], record["PartitionKey"])
    assert len(decoded) == len(results)
    for uid, result in enumerate(results):
        assert result.sub_sequence_number is not None
        assert decoded[result.sub_sequence_number].data == sent[uid].data
    record = by_sequence[single.shard_id, single.sequence_number]
    assert record["Data"] == alone  # sent raw
    assert record["PartitionKey"] == "alone"


# -- 3. a stream that does not exist ------------------------------------------------------


async def test_missing_stream_fails_fast_with_resource_not_found(
    producer_options: dict[str, Any],
) -> None:
    async with Producer(record_ttl=30, **producer_options) as producer:
        started = anyio.current_time()
        with pytest.raises(errors.RecordFailedError) as info:
            await producer.put_record("no-such-stream", b"data", partition_key="k")
        elapsed = anyio.current_time() - started
        # and a submitted one fails the same way
        pending = await producer.submit("no-such-stream", b"more", partition_key="k")
        with pytest.raises(errors.RecordFailedError) as info2:
            await pending
    assert elapsed < 5, f"took {elapsed:.1f} s to fail"
    for failure in (info.value, info2.value):
        result = failure.result
        assert not result.success
        assert result.shard_id is None
        assert result.sequence_number is None
        assert result.attempts[-1].error_code == "ResourceNotFoundException"
        assert failure.error_code == "ResourceNotFoundException"
        assert not result.attempts[-1].success
        assert len(result.attempts) == 1  # not retried


# -- 4. closing with records in flight ----------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("stream_exists", "close_timeout"),
    [
        pytest.param(True, 10.0, id="exists-10s"),
        pytest.param(True, 0.0, id="exists-0s"),
        pytest.param(True, 0.01, id="exists-10ms"),
        pytest.param(False, 0.0, id="missing-0s"),
        pytest.param(False, 10.0, id="missing-10s"),
    ],
)
async def test_close_with_records_in_flight(
    make_stream: Any,
    kinesis_client: Any,
    producer_options: dict[str, Any],
    stream_exists: bool,
    close_timeout: float,
) -> None:
    stream = make_stream(4) if stream_exists else "no-such-stream"
    sent = {uid: make_sent(uid, f"key-{uid % 300}") for uid in range(5000)}
    handles: dict[int, PendingRecord] = {}
    async with Producer(close_timeout=close_timeout, **producer_options) as producer:
        for uid, s in sent.items():
            handles[uid] = await producer.submit(stream, s.data, partition_key=s.partition_key)
        left_at = anyio.current_time()
    closed_in = anyio.current_time() - left_at

    assert closed_in < close_timeout + 2, f"closing took {closed_in:.1f} s"
    assert all(h.done() for h in handles.values())
    succeeded: set[int] = set()
    for uid, handle in handles.items():
        result = final_result(handle)
        if result.success:
            assert_success(result)
            succeeded.add(uid)
        else:
            assert result.attempts[-1].error_code in (
                "ProducerClosed",
                "ResourceNotFoundException",
            ), f"failed record {uid}: {result.attempts}"
    if stream_exists and close_timeout >= 10:
        assert succeeded == set(sent)
    if not stream_exists:
        assert not succeeded
        return
    arrived = check_read_back(await read_stream_async(kinesis_client, stream), sent)
    assert all(n == 1 for n in arrived.values())
    assert succeeded <= set(arrived)


# -- 5. cancellation ----------------------------------------------------------------------


@pytest.mark.timeout(120)
async def test_cancelling_one_putter_loses_nothing_of_the_others(
    make_stream: Any, kinesis_client: Any, producer_options: dict[str, Any]
) -> None:
    stream = make_stream(4)
    sent: dict[int, Sent] = {}
    confirmed: set[int] = set()
    submitted: dict[int, PendingRecord] = {}
    steady_uids: set[int] = set()
    next_uid = iter(range(10**6))

    async with Producer(**producer_options) as producer:

        async def put(uid: int, key: str, wait: bool) -> None:
            s = sent[uid] = make_sent(uid, key)
            if wait:
                await producer.put_record(stream, s.data, partition_key=s.partition_key)
                confirmed.add(uid)
            else:
                submitted[uid] = await producer.submit(
                    stream, s.data, partition_key=s.partition_key
                )

        async def steady(worker: int) -> None:
            for n in range(600):
                uid = next(next_uid)
                steady_uids.add(uid)
                await put(uid, f"steady-{worker}-{n % 40}", wait=n % 20 == 0)
                if n % 50 == 0:
                    await anyio.sleep(0.01)

        async def doomed() -> None:
            with anyio.move_on_after(0.3) as scope:
                for n in range(10**6):
                    await put(next(next_uid), f"doomed-{n % 40}", wait=n % 10 == 0)
            assert scope.cancelled_caught

        async with anyio.create_task_group() as tg:
            for worker in range(4):
                tg.start_soon(steady, worker)
            tg.start_soon(doomed)
        await producer.flush()
        # cancelling the putter cancelled its waits, never its records
        for uid, handle in submitted.items():
            assert_success(await handle)
            confirmed.add(uid)

    arrived = check_read_back(await read_stream_async(kinesis_client, stream), sent)
    duplicated = {uid: n for uid, n in arrived.items() if n > 1}
    assert not duplicated
    assert steady_uids <= set(arrived)
    assert confirmed <= set(arrived)
    doomed_uids = set(sent) - steady_uids
    assert doomed_uids & confirmed, "the doomed task put nothing before it was cancelled"
    assert doomed_uids - confirmed, "the doomed task was not cancelled mid-put"


@pytest.mark.timeout(60)
async def test_cancelling_around_the_producer_ends_it_promptly(
    make_stream: Any, kinesis_client: Any, producer_options: dict[str, Any]
) -> None:
    stream = make_stream(4)
    sent: dict[int, Sent] = {}
    handles: dict[int, PendingRecord] = {}
    with anyio.move_on_after(1.0) as scope:
        async with Producer(**producer_options) as producer:
            for uid in range(10**7):
                s = sent[uid] = make_sent(uid, f"key-{uid % 500}")
                handles[uid] = await producer.submit(stream, s.data, partition_key=s.partition_key)
                if uid % 100 == 0:
                    await anyio.lowlevel.checkpoint()
    ended_in = anyio.current_time() - scope.deadline
    assert scope.cancelled_caught
    assert ended_in < 2, f"the producer took {ended_in:.1f} s to end after cancellation"
    assert len(handles) > 1000
    assert all(h.done() for h in handles.values())
    succeeded = set()
    for uid, handle in handles.items():
        result = final_result(handle)
        if result.success:
            assert_success(result)
            succeeded.add(uid)
        else:
            assert result.attempts[-1].error_code == "ProducerClosed"
    assert succeeded, "nothing was delivered in the second before the cancellation"

    arrived = check_read_back(await read_stream_async(kinesis_client, stream), sent)
    assert all(n == 1 for n in arrived.values())
    assert succeeded <= set(arrived)


# -- 6. aggregation off -------------------------------------------------------------------


async def test_aggregation_off_sends_every_record_raw_to_its_shard(
    make_stream: Any, kinesis_client: Any, producer_options: dict[str, Any]
) -> None:
    stream = make_stream(4)
    sent = sent_with_hash_keys(2000, "key", keys=700, every=10, seed=7)
    async with Producer(aggregation_enabled=False, **producer_options) as producer:
        handles = [
            await producer.submit(stream, s.data, s.partition_key, s.explicit_hash_key)
            for s in sent.values()
        ]
        await producer.flush()
        results = [await h for h in handles]
    for result in results:
        assert_success(result)
        assert result.sub_sequence_number == 0

    contents = await read_stream_async(kinesis_client, stream)
    for records in contents.kinesis_records.values():
        for record in records:
            assert record["Data"][:4] != MAGIC
    arrived = check_read_back(contents, sent)
    assert arrived == Counter(set(sent))
    assert sum(len(r) for r in contents.kinesis_records.values()) == len(sent)


async def test_aggregates_under_their_first_records_keys(
    make_stream: Any, kinesis_client: Any, producer_options: dict[str, Any]
) -> None:
    """container_key_from_records: the stream holds aggregates whose partition keys are their
    first user records' (many keys, which Lambda's ParallelizationFactor can spread), each in
    the shard of its explicit hash key, and every user record once with its own key."""
    stream = make_stream(2)
    sent = {uid: make_sent(uid, f"device-{uid % 300}") for uid in range(3000)}
    async with Producer(container_key_from_records=True, **producer_options) as producer:
        handles = [await producer.submit(stream, s.data, s.partition_key) for s in sent.values()]
        for handle in handles:
            assert_success(await handle)
    contents = await read_stream_async(kinesis_client, stream)
    container_keys = set()
    aggregates = 0
    for records in contents.kinesis_records.values():
        for record in records:
            decoded = deaggregate(record["Data"], record["PartitionKey"])
            if bytes(record["Data"][:4]) == MAGIC and len(decoded) > 1:
                aggregates += 1
                assert record["PartitionKey"] == decoded[0].partition_key
                container_keys.add(record["PartitionKey"])
    assert aggregates >= 2
    assert len(container_keys) >= 2  # first keys of 3,000 records over 300 keys, not one
    assert "a" not in container_keys
    arrived = check_read_back(contents, sent)
    assert arrived == Counter(set(sent))


# -- a record larger than the aggregation limit, then a flush -----------------------------


async def test_flush_after_an_oversized_record(
    make_stream: Any, kinesis_client: Any, producer_options: dict[str, Any]
) -> None:
    stream = make_stream(1)
    big = make_sent(1, "big", size=60_000)
    small = make_sent(2, "small")
    async with Producer(aggregation_max_size=AGGREGATION_MAX_SIZE, **producer_options) as producer:
        await wait_for_shard_map(producer, stream)
        assert_success(await producer.put_record(stream, big.data, partition_key="big"))
        await producer.flush()
        assert_success(await producer.put_record(stream, small.data, partition_key="small"))
    contents = await read_stream_async(kinesis_client, stream)
    sent = {1: big, 2: small, 9_999_999: Sent(9_999_999, "warm-up", None, b"")}
    arrived: Counter[int] = Counter()
    for user_record in contents.user_records():
        uid = uid_of(user_record.decoded.data)
        if uid != 9_999_999:
            assert user_record.decoded.data == sent[uid].data
        arrived[uid] += 1
    assert arrived == Counter({1: 1, 2: 1, 9_999_999: 1})


# -- a record's result is fixed once it is terminal ---------------------------------------


@pytest.mark.timeout(120)
async def test_a_record_failed_at_close_ends_with_its_failing_attempt(
    make_stream: Any, producer_options: dict[str, Any]
) -> None:
    """Close while many small PutRecords are in flight, with close timeouts around how long
    they take, so that some responses arrive just as the close fails what is left. A record
    that ended in failure must say so in its last attempt (RecordFailedError reports the last
    attempt's code): an outcome that arrives later must not add to a terminal record."""
    stream = make_stream(2)
    inconsistent: list[RecordResult] = []
    for step in range(20):
        async with Producer(
            close_timeout=0.01 + (step % 10) * 0.005,
            record_max_buffered_time=0.02,
            aggregation_enabled=False,
            collection_max_count=5,
            **producer_options,
        ) as producer:
            await producer.put_record(stream, payload(9_999_999), partition_key="warm-up")
            handles = [
                await producer.submit(stream, payload(uid), partition_key=f"k{uid % 50}")
                for uid in range(1000)
            ]
        for handle in handles:
            result = final_result(handle)
            if result.success != result.attempts[-1].success:
                inconsistent.append(result)
        if inconsistent:
            break
    assert not inconsistent, (
        f"{len(inconsistent)} records whose outcome disagrees with their last attempt "
        f"(close {step + 1}), e.g. {inconsistent[0]}"
    )


# -- submit_many: a firehose's batches ------------------------------------------------------


async def test_submit_many_delivers_every_record_with_its_own_key(
    make_stream: Any, kinesis_client: Any, producer_options: dict[str, Any]
) -> None:
    stream = make_stream(4)
    sent = sent_with_hash_keys(6000, "device", keys=500, every=7, seed=11)
    items = list(sent.values())
    async with Producer(**producer_options) as producer:
        batches: list[PendingBatch] = []
        for start in range(0, len(items), 500):
            batch = items[start : start + 500]
            batches.append(
                await producer.submit_many(
                    stream, [(s.data, s.partition_key, s.explicit_hash_key) for s in batch]
                )
            )
        await producer.flush()
        assert all(batch.done() for batch in batches)
        outcomes = [await batch for batch in batches]
        handles = [handle for batch in batches for handle in batch]
        results = [await handle for handle in handles]
    assert [(o.succeeded, o.failed, o.failures) for o in outcomes] == [(500, 0, ())] * 12
    assert [uid_of(h.data) for h in handles] == list(sent)
    for result in results:
        assert_success(result)
    contents = await read_stream_async(kinesis_client, stream)
    # check_read_back compares each user record's own partition key with what was sent
    assert check_read_back(contents, sent) == Counter(set(sent))


async def test_submit_many_of_data_and_key_goes_in_columns_and_delivers_every_record(
    make_stream: Any, kinesis_client: Any, producer_options: dict[str, Any]
) -> None:
    """Batches of ``(data, partition_key)`` once the shard map is ready are admitted in columns
    (no record made per item); every record delivered, with its key, and each handle, asked
    for after the batch is done, says where it is."""
    stream = make_stream(4)
    sent = {uid: make_sent(uid, f"device-{uid % 500}") for uid in range(6001)}
    first, *items = sent.values()
    async with Producer(**producer_options) as producer:
        # the shard map ready (a batch before it goes the per-record way)
        await producer.put_record(stream, first.data, first.partition_key)
        admitted = len(producer._intake.column_batches)
        batches: list[PendingBatch] = []
        for start in range(0, len(items), 500):
            batch = items[start : start + 500]
            batches.append(
                await producer.submit_many(stream, [(s.data, s.partition_key) for s in batch])
            )
        assert len(producer._intake.column_batches) - admitted == 12
        await producer.flush()
        outcomes = [await batch for batch in batches]
        handles = [handle for batch in batches for handle in batch]
        results = [await handle for handle in handles]
    assert [(o.succeeded, o.failed, o.failures) for o in outcomes] == [(500, 0, ())] * 12
    assert [uid_of(h.data) for h in handles] == list(sent)[1:]
    for result in results:
        assert_success(result)
    contents = await read_stream_async(kinesis_client, stream)
    assert check_read_back(contents, sent) == Counter(set(sent))


async def test_awaiting_done_handles_lets_others_run_and_ends_when_cancelled(
    make_stream: Any, kinesis_client: Any, producer_options: dict[str, Any]
) -> None:
    # awaiting a handle whose result is there is a cancellation check (trio) or nothing
    # (asyncio), not a trip through the event loop; one await in RESOLVED_YIELD_EVERY is a
    # full checkpoint (docs/architecture.md, admission)
    stream = make_stream(2)
    sent = {uid: make_sent(uid, f"key-{uid}") for uid in range(641)}
    last = sent[640]
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.lowlevel.checkpoint()

    async with Producer(**producer_options) as producer:
        handles = [
            await producer.submit(stream, s.data, s.partition_key)
            for s in sent.values()
            if s != last
        ]
        batch = await producer.submit_many(stream, [(last.data, last.partition_key)])
        await producer.flush()
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            await anyio.lowlevel.checkpoint()
            before = ticks
            results = [await handle for handle in handles]
            assert 640 // RESOLVED_YIELD_EVERY - 1 <= ticks - before <= 640 // 8
            tg.cancel_scope.cancel()
        awaited = 0
        with anyio.CancelScope() as scope:
            scope.cancel()
            for handle in handles:
                await handle
                await batch
                awaited += 1
        assert scope.cancelled_caught
        assert awaited < RESOLVED_YIELD_EVERY
        assert (await batch).succeeded == 1
    for result in results:
        assert_success(result)
    contents = await read_stream_async(kinesis_client, stream)
    assert check_read_back(contents, sent) == Counter(set(sent))


async def test_records_stay_out_of_the_garbage_collector_and_go_with_their_handles(
    make_stream: Any, kinesis_client: Any, producer_options: dict[str, Any]
) -> None:
    # The producer's records are not tracked by the cyclic garbage collector in either build
    # (CPython): a firehose's records set off collections over the whole process otherwise
    # (docs/benchmarks.md). What makes that safe: once a record is terminal, nothing but the
    # caller's handle refers to it, so it goes when the handle goes.
    stream = make_stream(2)
    sent = sent_with_hash_keys(400, "key", keys=40, every=5, seed=5)
    async with Producer(**producer_options) as producer:
        handles = [
            await producer.submit(stream, s.data, s.partition_key, s.explicit_hash_key)
            for s in sent.values()
        ]
        if sys.implementation.name == "cpython":
            assert not any(gc.is_tracked(handle) for handle in handles)
        results = [await handle for handle in handles]
    for result in results:
        assert_success(result)
    gc.collect()  # what refers to a record from garbage that is yet to be collected
    for handle in handles:
        # at most the list's reference, the loop's and getrefcount's argument (an interpreter
        # may borrow some of them)
        assert sys.getrefcount(handle) <= 3
    del handle
    contents = await read_stream_async(kinesis_client, stream)
    assert check_read_back(contents, sent) == Counter(set(sent))


# -- an httpx body sent in pieces -----------------------------------------------------------


async def test_httpx_sends_kept_bodies_in_pieces_that_arrive_whole(
    make_stream: Any,
    kinesis_client: Any,
    producer_options: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over httpx (trio's HTTP client, here on both backends), each PutRecords body is sent in
    pieces of a kept buffer (``_botocore._BodyPieces``). With pieces of an odd 1,000 bytes, so
    every request has many and they cut through records, the stream holds every record."""
    from anykpl._transport import _botocore as _sender

    monkeypatch.setattr(_sender, "BODY_PIECE", 1000)
    pieces = Counter[str]()
    iterate = _sender._BodyPieces.__iter__

    def counting(self: Any) -> Iterator[memoryview]:
        for piece in iterate(self):
            pieces["pieces"] += 1
            yield piece

    monkeypatch.setattr(_sender._BodyPieces, "__iter__", counting)
    stream = make_stream(2)
    sent = {
        uid: make_sent(uid, f"device-{uid % 50}", size=100 + uid * 37 % 3000) for uid in range(600)
    }
    async with Producer(http_backend="httpx", **producer_options) as producer:
        handles = [await producer.submit(stream, s.data, s.partition_key) for s in sent.values()]
        await producer.flush()
        results = [await h for h in handles]
    for result in results:
        assert_success(result)
    assert pieces["pieces"] > 900  # about 1 MB of records, and some JSON and base64 around them
    contents = await read_stream_async(kinesis_client, stream)
    assert check_read_back(contents, sent) == Counter(set(sent))
