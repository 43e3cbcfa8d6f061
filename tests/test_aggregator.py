"""The Aggregator: user records → Kinesis records per predicted shard (pure, no event loop)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anykpl._core import _wire
from anykpl._core._aggregator import SHARD_MAP_WAIT, Aggregator
from anykpl._core._limiter import EXPIRY_SCAN_INTERVAL
from anykpl._core._records import KinesisRecord, Record, partition_key_hash
from anykpl._core._shard_queue import FAIR_QUANTUM

SHARD = "shardId-000000000000"


def make_record(
    partition_key: str = "pk",
    data: bytes = b"data",
    *,
    explicit_hash_key: int | None = None,
    deadline: float = 1.0,
    expiration: float = 30.0,
) -> Record:
    hash_key = partition_key_hash(partition_key) if explicit_hash_key is None else explicit_hash_key
    ehk = None if explicit_hash_key is None else str(explicit_hash_key)
    return Record("stream", partition_key, data, hash_key, ehk, 0.0, deadline, expiration)


def make_aggregator(
    *,
    enabled: bool = True,
    max_size: int = 51200,
    max_count: int = 4294967295,
    predict: Callable[[int], str | None] = lambda _: SHARD,
    container_key_from_records: bool = False,
) -> Aggregator:
    return Aggregator(
        enabled=enabled,
        max_size=max_size,
        max_count=max_count,
        container_partition_key="a",
        predict=predict,
        container_key_from_records=container_key_from_records,
    )


def _decoded(kr: KinesisRecord) -> list[tuple[str, bytes]]:
    return [(r.partition_key, r.data) for r in _wire.deaggregate(kr.data, kr.partition_key)]


def test_one_record_is_sent_raw() -> None:
    agg = make_aggregator()
    record = make_record("k", b"hello")
    out: list[KinesisRecord] = []
    assert agg.put(record, out)  # first deadline: wake the timer
    assert out == []
    assert agg.buffered_records == 1
    assert agg.queue_depths() == {SHARD: 1}
    agg.flush_all(out)
    (kr,) = out
    assert kr.records == [record]
    assert kr.data == b"hello"
    assert kr.partition_key == "k"
    assert kr.explicit_hash_key == str(partition_key_hash("k"))  # always set, as in the KPL
    assert kr.predicted_shard == SHARD
    assert record.predicted_shard == SHARD
    assert agg.buffered_records == 0


def test_several_records_make_an_aggregate() -> None:
    agg = make_aggregator()
    records = [
        make_record("a", b"1"),
        make_record("b", b"22", explicit_hash_key=5),
        make_record("a", b"333"),
    ]
    out: list[KinesisRecord] = []
    for record in records:
        agg.put(record, out)
    agg.flush_all(out)
    (kr,) = out
    assert kr.records == records
    assert kr.data.startswith(_wire.MAGIC)
    assert kr.partition_key == "a"  # the container partition key
    assert kr.explicit_hash_key == str(partition_key_hash("a"))  # the first record's hash key
    decoded = _wire.deaggregate(kr.data, kr.partition_key)
    assert [(r.partition_key, r.explicit_hash_key, r.data) for r in decoded] == [
        ("a", None, b"1"),
        ("b", "5", b"22"),
        ("a", None, b"333"),
    ]
    assert kr.size == len(kr.data) + 1


def test_first_records_explicit_hash_key_is_the_aggregates() -> None:
    agg = make_aggregator()
    out: list[KinesisRecord] = []
    agg.put(make_record("x", explicit_hash_key=42), out)
    agg.put(make_record("y"), out)
    agg.flush_all(out)
    assert out[0].explicit_hash_key == "42"


def test_an_aggregate_can_take_its_first_records_partition_key() -> None:
    """container_key_from_records: each aggregate under its first user record's key (Lambda's
    ParallelizationFactor can spread them); by default the constant container key."""
    for from_records, expected in ((False, "a"), (True, "device-7")):
        agg = Aggregator(
            enabled=True,
            max_size=51200,
            max_count=4294967295,
            container_partition_key="a",
            predict=lambda _: SHARD,
            container_key_from_records=from_records,
        )
        out: list[KinesisRecord] = []
        for key in ("device-7", "device-8", "device-7"):
            agg.put(make_record(key, b"x"), out)
        agg.flush_all(out)
        (kr,) = out
        assert kr.partition_key == expected
        assert [key for key, _ in _decoded(kr)] == ["device-7", "device-8", "device-7"]


@pytest.mark.parametrize("from_records", [False, True])
def test_an_aggregate_and_its_partition_key_stay_within_the_limit(from_records: bool) -> None:
    """The service counts a Kinesis record's data and partition key against its maximum: an
    aggregate's bytes plus its key stay within aggregation_max_size, with the constant key and
    with long first keys (container_key_from_records)."""
    limit = 20_000
    agg = Aggregator(
        enabled=True,
        max_size=limit,
        max_count=4294967295,
        container_partition_key="container-" + "k" * 200,
        predict=lambda _: SHARD,
        container_key_from_records=from_records,
    )
    out: list[KinesisRecord] = []
    for i in range(400):
        agg.put(make_record(f"{i:03d}" + "p" * 250, b"x" * 977), out)
    agg.flush_all(out)
    aggregates = [kr for kr in out if len(kr.records) > 1]
    assert len(aggregates) > 5
    assert all(len(kr.data) + len(kr.partition_key.encode()) <= limit for kr in aggregates)
    # and they are full, not cut short: the next record would not have fit
    assert all(
        len(kr.data) + len(kr.partition_key.encode()) > limit - 1500 for kr in aggregates[:-1]
    )


def test_count_limit() -> None:
    agg = make_aggregator(max_count=3)
    records = [make_record(f"k{i}", b"x") for i in range(10)]
    out: list[KinesisRecord] = []
    for record in records:
        agg.put(record, out)
    assert [len(kr.records) for kr in out] == [3, 3, 3]
    agg.flush_all(out)
    assert [len(kr.records) for kr in out] == [3, 3, 3, 1]
    assert [r for kr in out for r in kr.records] == records


def test_count_limit_seals_as_soon_as_it_is_reached() -> None:
    """A full aggregate can take nothing more: it goes out at once (the KPL's Reducer flushes
    when ``size() >= count_limit`` after an add), not when the next record or the deadline
    comes."""
    agg = make_aggregator(max_count=3)
    records = [make_record(f"k{i}", b"x") for i in range(3)]
    out: list[KinesisRecord] = []
    for record in records:
        agg.put(record, out)
    assert [kr.records for kr in out] == [records]
    assert agg.buffered_records == 0


def test_size_limit_seals_before_the_limit_is_passed() -> None:
    agg = make_aggregator(max_size=200)
    records = [make_record(f"k{i}", bytes(40)) for i in range(20)]
    out: list[KinesisRecord] = []
    for record in records:
        agg.put(record, out)
    agg.flush_all(out)
    assert len(out) > 1
    for kr in out:
        assert len(kr.data) <= 200
        assert _decoded(kr) == [(r.partition_key, r.data) for r in kr.records]
    assert [r for kr in out for r in kr.records] == records


def test_oversized_record_goes_out_alone_and_raw() -> None:
    agg = make_aggregator(max_size=100)
    small = make_record("s", b"x")
    big = make_record("b", bytes(150))
    out: list[KinesisRecord] = []
    agg.put(small, out)
    agg.put(big, out)
    # the big record goes out at once, on its own and raw
    assert [kr.records for kr in out][-1] == [big]
    assert out[-1].data == bytes(150)
    assert out[-1].partition_key == "b"
    agg.flush_all(out)
    assert sorted(len(kr.data) for kr in out) == [1, 150]
    assert agg.buffered_records == 0


def test_flush_after_an_oversized_record() -> None:
    """A record too big to aggregate, then a manual flush (as close does)."""
    agg = make_aggregator(max_size=100)
    big = make_record("b", bytes(150))
    out: list[KinesisRecord] = []
    agg.put(big, out)
    assert [kr.records for kr in out] == [[big]]
    out.clear()
    agg.flush_all(out)  # nothing is buffered: nothing to seal, and certainly no crash
    assert out == []
    assert agg.next_deadline == math.inf


def test_records_wait_for_the_shard_map_then_aggregate() -> None:
    ready = False
    agg = make_aggregator(predict=lambda _: SHARD if ready else None)
    first, second = make_record("a", deadline=1.0), make_record("b", deadline=1.2)
    out: list[KinesisRecord] = []
    assert agg.put(first, out)  # the first waiting record sets a deadline: wake the timer
    assert not agg.put(second, out)
    assert out == []
    assert agg.waiting_for_shard_map == 2
    assert agg.buffered_records == 2
    assert agg.next_deadline == 1.0 + SHARD_MAP_WAIT
    agg.flush_due(0.5, out)  # the map is still not ready: they keep waiting
    assert out == []
    ready = True
    agg.flush_due(0.6, out)  # ready: they join an aggregate, due at the first deadline
    assert out == []
    assert agg.waiting_for_shard_map == 0
    assert agg.queue_depths() == {SHARD: 2}
    assert agg.next_deadline == 1.0
    agg.flush_due(1.0, out)
    (kr,) = out
    assert kr.records == [first, second]
    assert kr.predicted_shard == SHARD


def test_records_wait_for_the_shard_map_no_longer_than_their_ttl() -> None:
    # a record_ttl shorter than the wait: each fails as expired when its TTL passes (unsent:
    # take_expired), the others keep waiting
    ready = False
    agg = make_aggregator(predict=lambda _: SHARD if ready else None)
    first = make_record("a", deadline=1.0, expiration=2.0)
    out: list[KinesisRecord] = []
    assert agg.put(first, out)
    assert agg.next_deadline == 2.0
    # one that expires sooner (a retried record, say) brings the wake-up forward
    retried = make_record("b", deadline=1.1, expiration=1.5)
    assert agg.put(retried, out)
    assert agg.next_deadline == 1.5
    assert not agg.put(make_record("c", deadline=1.2, expiration=30.0), out)
    agg.flush_due(1.49, out)
    assert (out, agg.take_expired()) == ([], [])
    agg.flush_due(1.5, out)
    assert out == []
    assert agg.take_expired() == [retried]
    assert agg.take_expired() == []
    assert (agg.waiting_for_shard_map, agg.buffered_records) == (2, 2)
    assert agg.next_deadline == 2.0
    agg.flush_due(2.0, out)
    assert (out, agg.take_expired()) == ([], [first])
    assert agg.next_deadline == 1.0 + SHARD_MAP_WAIT  # the first one's wait, unchanged
    ready = True  # the map comes: the one left goes by its shard (its deadline is past)
    agg.flush_due(2.5, out)
    assert agg.waiting_for_shard_map == agg.buffered_records == 0
    assert [(kr.records[0].partition_key, kr.predicted_shard) for kr in out] == [("c", SHARD)]


def test_records_expiring_one_by_one_wake_the_aggregator_at_most_every_scan_interval() -> None:
    agg = make_aggregator(predict=lambda _: None)
    out: list[KinesisRecord] = []
    records = [make_record(f"k{i}", deadline=1.0, expiration=2.0 + i * 0.01) for i in range(50)]
    for record in records:
        agg.put(record, out)
    agg.flush_due(2.0, out)
    assert agg.take_expired() == records[:1]
    assert agg.next_deadline == 2.0 + EXPIRY_SCAN_INTERVAL
    agg.flush_due(2.0 + EXPIRY_SCAN_INTERVAL, out)
    assert agg.take_expired() == records[1:26]
    assert out == []


def test_records_that_all_expire_waiting_for_the_shard_map_leave_no_wake_up() -> None:
    agg = make_aggregator(predict=lambda _: None)
    out: list[KinesisRecord] = []
    agg.put(make_record("a", deadline=1.0, expiration=1.5), out)
    agg.flush_due(1.5, out)
    assert (out, len(agg.take_expired())) == ([], 1)
    assert (agg.waiting_for_shard_map, agg.buffered_records) == (0, 0)
    assert agg.next_deadline == math.inf
    # the next record waits its own full wait
    agg.put(make_record("b", deadline=4.0), out)
    assert agg.next_deadline == 4.0 + SHARD_MAP_WAIT


def test_at_the_waits_end_expired_records_are_not_sent_raw() -> None:
    agg = make_aggregator(predict=lambda _: None)
    out: list[KinesisRecord] = []
    old = make_record("a", deadline=1.0, expiration=1.0 + SHARD_MAP_WAIT)
    young = make_record("b", deadline=1.0)
    agg.put(old, out)
    agg.put(young, out)
    agg.flush_due(1.0 + SHARD_MAP_WAIT, out)
    assert [kr.records for kr in out] == [[young]]
    assert agg.take_expired() == [old]
    assert agg.buffered_records == 0


def test_a_map_ready_between_looks_does_not_aggregate_a_record_past_its_ttl() -> None:
    # (its aggregate would expire with it: an aggregate expires at its first record's TTL)
    ready = False
    agg = make_aggregator(predict=lambda _: SHARD if ready else None)
    out: list[KinesisRecord] = []
    old = make_record("a", deadline=1.0, expiration=1.1)
    young = make_record("b", deadline=1.2, expiration=30.0)
    agg.put(old, out)
    agg.put(young, out)
    ready = True
    agg.flush_due(1.15, out)  # ready, and the first one's TTL has passed since the last look
    assert agg.take_expired() == [old]
    assert agg.queue_depths() == {SHARD: 1}
    agg.flush_due(1.2, out)
    (kr,) = out
    assert (kr.records, kr.expiration) == ([young], 30.0)


def test_a_flush_does_not_aggregate_a_record_past_its_ttl() -> None:
    ready = False
    agg = make_aggregator(predict=lambda _: SHARD if ready else None)
    out: list[KinesisRecord] = []
    old, young = make_record("a", expiration=1.1), make_record("b", expiration=30.0)
    agg.put(old, out)
    agg.put(young, out)
    agg.flush_all(out, 1.0)  # the map is not ready: both keep waiting
    assert (out, agg.take_expired(), agg.waiting_for_shard_map) == ([], [], 2)
    ready = True
    agg.flush_all(out, 1.15)
    assert agg.take_expired() == [old]
    assert [kr.records for kr in out] == [[young]]


def test_a_shard_map_that_fails_for_good_mid_wait_releases_every_waiting_record() -> None:
    agg = make_aggregator(predict=lambda _: None)
    out: list[KinesisRecord] = []
    record = make_record("a", deadline=1.0, expiration=30.0)
    agg.put(record, out)
    assert agg.shard_map_failed()
    agg.flush_due(0.5, out)
    assert [kr.records for kr in out] == [[record]]
    assert agg.take_expired() == []


def test_failing_everything_takes_the_expired_records_not_yet_taken() -> None:
    agg = make_aggregator(predict=lambda _: None)
    out: list[KinesisRecord] = []
    expired, waiting = make_record("a", deadline=1.0, expiration=1.5), make_record("b")
    agg.put(expired, out)
    agg.put(waiting, out)
    agg.flush_due(1.5, out)
    assert sorted(r.partition_key for r in agg.take_all_records()) == ["a", "b"]
    assert agg.take_expired() == []


def test_records_go_out_raw_when_the_shard_map_never_comes() -> None:
    agg = make_aggregator(predict=lambda _: None)
    record = make_record(deadline=1.0)
    record.predicted_shard = "shardId-000000000009"  # left over from an earlier attempt
    out: list[KinesisRecord] = []
    agg.put(record, out)
    agg.flush_due(1.0 + SHARD_MAP_WAIT - 0.01, out)
    assert out == []
    agg.flush_due(1.0 + SHARD_MAP_WAIT, out)
    (kr,) = out
    assert kr.records == [record]
    assert kr.predicted_shard is None
    assert record.predicted_shard is None
    assert agg.buffered_records == 0
    assert agg.next_deadline == math.inf


def test_a_flush_leaves_records_waiting_for_the_shard_map_to_wait() -> None:
    """A flush does not force records out raw and past the limiter while the shard map is
    not ready: they go when it is (aggregated), or raw when their own wait ends."""
    ready = False
    agg = make_aggregator(predict=lambda _: "shardId-000000000000" if ready else None)
    out: list[KinesisRecord] = []
    agg.put(make_record("a", deadline=1.0), out)
    agg.put(make_record("b", deadline=1.0), out)
    agg.flush_all(out)
    assert out == []
    assert agg.waiting_for_shard_map == 2
    ready = True
    agg.flush_all(out)
    assert [len(kr.records) for kr in out] == [2]  # one aggregate
    assert agg.waiting_for_shard_map == 0


def test_a_flush_that_found_records_waiting_for_the_shard_map_is_due_when_they_go() -> None:
    """Flushed while they waited for the map, records must not then wait out their buffered
    time (30 s, say) in an aggregate once the map is ready: the flush is due again."""
    ready = False
    agg = make_aggregator(predict=lambda _: "shardId-000000000000" if ready else None)
    out: list[KinesisRecord] = []
    agg.put(make_record("a", deadline=30.0), out)
    agg.flush_all(out)
    assert not agg.deferred_flush_due()
    ready = True
    agg.flush_due(0.5, out)  # the map is ready: they are aggregated, not yet sealed
    assert out == []
    assert agg.deferred_flush_due()
    assert not agg.deferred_flush_due()  # once
    agg.flush_all(out)
    assert [len(kr.records) for kr in out] == [1]


def test_records_go_raw_at_once_while_the_shard_map_is_unavailable() -> None:
    """ListShards failed for good (a missing stream): records do not wait for a map that
    will not come, they go raw and fail fast with the service's error."""
    agg = make_aggregator(predict=lambda _: None)
    agg.shard_map_failed()
    out: list[KinesisRecord] = []
    agg.put(make_record("a", deadline=1.0), out)
    assert [len(kr.records) for kr in out] == [1]
    assert agg.waiting_for_shard_map == 0


def test_records_waiting_for_the_shard_map_go_raw_when_their_wait_ends() -> None:
    agg = make_aggregator(predict=lambda _: None)
    out: list[KinesisRecord] = []
    agg.put(make_record("a", deadline=1.0), out)
    agg.flush_all(out)
    agg.flush_due(1.0 + SHARD_MAP_WAIT, out)
    assert [len(kr.records) for kr in out] == [1]
    assert agg.waiting_for_shard_map == 0


def test_records_waiting_for_the_shard_map_are_taken_when_failing_everything() -> None:
    agg = make_aggregator(predict=lambda _: None)
    record = make_record()
    agg.put(record, [])
    assert agg.take_all_records() == [record]
    assert agg.buffered_records == 0
    assert agg.next_deadline == math.inf


def test_aggregation_off_still_predicts_the_shard() -> None:
    agg = make_aggregator(enabled=False)
    out: list[KinesisRecord] = []
    agg.put(make_record("a"), out)
    agg.put(make_record("b"), out)
    assert [len(kr.records) for kr in out] == [1, 1]
    assert all(kr.predicted_shard == SHARD for kr in out)  # so the limiter applies


def test_records_are_grouped_by_predicted_shard() -> None:
    agg = make_aggregator(predict=lambda h: f"shard-{h % 3}")
    records = [make_record(f"k{i}", explicit_hash_key=i) for i in range(9)]
    out: list[KinesisRecord] = []
    for record in records:
        agg.put(record, out)
    assert agg.queue_depths() == {"shard-0": 3, "shard-1": 3, "shard-2": 3}
    agg.flush_all(out)
    assert sorted(kr.predicted_shard or "" for kr in out) == ["shard-0", "shard-1", "shard-2"]
    for kr in out:
        assert {r.hash_key % 3 for r in kr.records} == {int(str(kr.predicted_shard)[-1])}


def test_deadlines_flush_due_aggregates_only() -> None:
    shards = {1: "shard-a", 2: "shard-b", 3: "shard-c"}
    agg = make_aggregator(predict=lambda h: shards[h])
    out: list[KinesisRecord] = []
    assert agg.next_deadline == math.inf
    assert agg.put(make_record("a", explicit_hash_key=1, deadline=5.0), out)
    assert agg.put(make_record("b", explicit_hash_key=2, deadline=3.0), out)
    assert agg.put(make_record("c", explicit_hash_key=3, deadline=4.0), out)
    # a later deadline on the same shard does not move the aggregate's deadline
    assert not agg.put(make_record("a2", explicit_hash_key=1, deadline=9.0), out)
    # an earlier one does
    assert agg.put(make_record("c2", explicit_hash_key=3, deadline=2.0), out)
    assert agg.next_deadline == 2.0
    agg.flush_due(1.9, out)
    assert out == []
    agg.flush_due(3.0, out)
    assert [kr.predicted_shard for kr in out] == ["shard-c", "shard-b"]
    assert out[0].deadline == 2.0
    assert agg.next_deadline == 5.0
    out.clear()
    agg.flush_due(100.0, out)
    assert [kr.predicted_shard for kr in out] == ["shard-a"]
    assert len(out[0].records) == 2
    assert agg.next_deadline == math.inf
    assert agg.buffered_records == 0


def test_deadline_of_a_sealed_aggregate_does_not_flush_its_successor() -> None:
    agg = make_aggregator(max_count=2)
    out: list[KinesisRecord] = []
    agg.put(make_record("a", deadline=1.0), out)
    agg.put(make_record("b", deadline=5.0), out)  # full by count: sealed at once
    agg.put(make_record("c", deadline=10.0), out)
    assert len(out) == 1
    agg.flush_due(2.0, out)
    assert len(out) == 1
    assert agg.next_deadline == 10.0


def test_aggregate_carries_earliest_deadline_and_expiration() -> None:
    agg = make_aggregator()
    out: list[KinesisRecord] = []
    agg.put(make_record("a", deadline=3.0, expiration=9.0), out)
    agg.put(make_record("b", deadline=2.0, expiration=20.0), out)
    agg.put(make_record("c", deadline=4.0, expiration=7.0), out)
    agg.flush_all(out)
    assert (out[0].deadline, out[0].expiration) == (2.0, 7.0)


def test_take_all_records() -> None:
    agg = make_aggregator(predict=lambda h: f"s{h % 2}")
    records = [make_record(f"k{i}", explicit_hash_key=i) for i in range(5)]
    out: list[KinesisRecord] = []
    for record in records:
        agg.put(record, out)
    assert sorted(agg.take_all_records(), key=lambda r: r.hash_key) == records
    assert agg.buffered_records == 0
    assert agg.queue_depths() == {}
    assert agg.next_deadline == math.inf


_user_records = st.lists(
    st.tuples(
        st.text(min_size=1, max_size=12),
        st.binary(max_size=300),
        st.one_of(st.none(), st.integers(min_value=0, max_value=(1 << 128) - 1)),
        st.integers(min_value=0, max_value=3),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(_user_records, st.integers(min_value=64, max_value=600), st.integers(1, 8))
def test_aggregates_never_exceed_the_size_limit_and_decode_exactly(
    specs: list[tuple[str, bytes, int | None, int]], max_size: int, max_count: int
) -> None:
    agg = make_aggregator(max_size=max_size, max_count=max_count, predict=lambda h: f"s{h % 3}")
    records = []
    out: list[KinesisRecord] = []
    for partition_key, data, ehk, deadline in specs:
        record = make_record(partition_key, data, explicit_hash_key=ehk, deadline=deadline)
        records.append(record)
        agg.put(record, out)
        agg.flush_due(deadline / 2, out)
    agg.flush_all(out)
    assert sorted(id(r) for kr in out for r in kr.records) == sorted(id(r) for r in records)
    for kr in out:
        assert 1 <= len(kr.records) <= max_count
        assert kr.size == len(kr.data) + len(kr.partition_key.encode())  # UTF-8 bytes
        if len(kr.records) == 1:
            (record,) = kr.records
            assert kr.data == record.data
            assert kr.partition_key == record.partition_key
        else:
            assert len(kr.data) <= max_size
            assert len({r.predicted_shard for r in kr.records}) == 1
            decoded = _wire.deaggregate(kr.data, kr.partition_key)
            assert [(d.partition_key, d.explicit_hash_key, d.data) for d in decoded] == [
                (r.partition_key, r.explicit_hash_key, r.data) for r in kr.records
            ]


@settings(max_examples=50, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3000), min_size=2, max_size=60),
    ehks=st.booleans(),
    max_size=st.sampled_from([512, 4096, 10 * 1024]),
)
def test_a_split_aggregate_carries_the_same_records_in_order(
    sizes: list[int], ehks: bool, max_size: int
) -> None:
    """What the Limiter sends while a controller samples: pieces of at most ``max_size``
    bytes (or one record alone), each a valid Kinesis record of the predicted shard, their
    user records together those of the aggregate, in order, with their own keys."""
    agg = make_aggregator()
    records = [
        make_record(f"key-{i % 7}", bytes([i % 251]) * size, explicit_hash_key=i if ehks else None)
        for i, size in enumerate(sizes)
    ]
    out: list[KinesisRecord] = []
    for record in records:
        agg.put(record, out)
    agg.flush_all(out)
    expected = [(r.partition_key, r.explicit_hash_key, r.data) for kr in out for r in kr.records]
    pieces = [piece for kr in out for piece in kr.split(max_size)]
    got: list[tuple[str, str | None, bytes]] = []
    for piece in pieces:
        assert piece.predicted_shard == SHARD
        if len(piece.records) > 1:
            assert piece.size <= max_size + len(piece.partition_key)
        decoded = _wire.deaggregate(piece.data, piece.partition_key, piece.explicit_hash_key)
        if len(piece.records) == 1:
            # sent raw, as the Aggregator sends a record alone: its hash key is explicit
            (record,) = piece.records
            assert decoded[0].explicit_hash_key == str(record.hash_key)
            got.append((decoded[0].partition_key, record.explicit_hash_key, decoded[0].data))
            continue
        got += [(d.partition_key, d.explicit_hash_key, d.data) for d in decoded]
        assert piece.deadline == min(r.deadline for r in piece.records)
        assert piece.expiration == min(r.expiration for r in piece.records)
    assert got == expected


def test_a_serialized_aggregate_or_a_raw_record_is_not_split() -> None:
    agg = make_aggregator()
    out: list[KinesisRecord] = []
    for i in range(10):
        agg.put(make_record(f"k{i}", bytes(1000)), out)
    agg.flush_all(out)
    (kr,) = out
    raw = KinesisRecord.single(make_record("k", bytes(5000)))
    assert raw.split(1000) == [raw]
    assert kr.split(100_000) == [kr]
    assert kr.data  # serialized for a request: its builder is gone
    assert kr.split(1000) == [kr]


def _arrived(key: str, hash_key: int, arrival: float, size: int = 1000) -> Record:
    return Record("stream", key, b"x" * size, hash_key, str(hash_key), arrival, arrival + 0.1, 30.0)


def test_seal_all_leaves_busy_shards_and_aggregates_about_to_fill_gathering() -> None:
    """Adaptive batching's early seal: a busy shard's aggregate (its records wait for tokens)
    keeps gathering; with a horizon, so does one of two or more records that fills within it
    at the pace it has been filling, and its deadline comes at the horizon's end at the latest
    (``seal_all`` says so); the rest go."""
    shards = {1: "busy", 2: "fast", 3: "slow"}
    agg = make_aggregator(predict=lambda h: shards[h], max_size=10_000)
    out: list[KinesisRecord] = []
    for i in range(3):
        agg.put(_arrived(f"b{i}", 1, 1.0), out)
    # "fast": 5 KB in 10 ms, so the other 5 KB would come in the next 10 ms
    for i in range(5):
        agg.put(_arrived(f"f{i}", 2, 0.99 + i * 0.0025), out)
    # "slow": 2 KB in 0.5 s: 4 s more to fill
    agg.put(_arrived("s0", 3, 0.5), out)
    agg.put(_arrived("s1", 3, 0.9), out)
    assert not out
    assert agg.seal_all(out, {"busy"}, now=1.0, horizon=0.05)
    assert [kr.predicted_shard for kr in out] == ["slow"]
    assert agg.queue_depths() == {"busy": 3, "fast": 5}
    assert agg.next_deadline == pytest.approx(1.05)  # "fast" goes by the horizon's end
    out.clear()
    agg.flush_due(1.05, out)
    assert [kr.predicted_shard for kr in out] == ["fast"]
    # without a horizon, only the busy shard's aggregate stays
    out.clear()
    agg.put(_arrived("f9", 2, 1.06), out)
    assert not agg.seal_all(out, {"busy"})  # nothing left filling (the busy one goes later)
    assert [kr.predicted_shard for kr in out] == ["fast"]
    assert agg.open_aggregates == 1
    # a lone record tells no pace: it goes, horizon or not
    agg.put(_arrived("s9", 3, 1.1), out)
    assert not agg.seal_all(out, {"busy"}, now=1.1, horizon=10.0)
    assert out[-1].predicted_shard == "slow"
    assert not agg.seal_all(out)
    assert agg.open_aggregates == 0


def test_seal_all_holds_back_only_the_busy_lanes_of_a_shard() -> None:
    """With tenants, a busy lane is a ``(shard, tenant)``: the tenant whose records wait for
    tokens keeps gathering, another tenant's aggregate on the same shard goes, and so does
    the shard's aggregate of records without a tenant unless its own lane waits."""
    agg = make_aggregator(predict=lambda h: "shard", max_size=10_000)
    out: list[KinesisRecord] = []
    for tenant in ("noisy", "quiet", None):
        record = _arrived(f"{tenant}", 1, 1.0)
        record.tenant = tenant
        agg.put(record, out)
    assert agg.open_aggregates == 3
    busy: set[str | tuple[str, str]] = {("shard", "noisy")}
    assert agg.open_outside(busy)
    agg.seal_all(out, busy)
    assert sorted(str(kr.tenant) for kr in out) == ["None", "quiet"]
    assert agg.open_aggregates == 1
    assert not agg.open_outside(busy)
    out.clear()
    record = _arrived("plain", 1, 1.1)
    agg.put(record, out)
    agg.seal_all(out, {"shard", ("shard", "noisy")})
    assert not out  # the lane without a tenant waits too now


@pytest.mark.parametrize("container_key_from_records", [False, True])
def test_a_tenants_aggregates_hold_one_turn_of_the_fair_queue(
    container_key_from_records: bool,
) -> None:
    """A tenant's aggregates stop at FAIR_QUANTUM (16 KiB) where aggregation_max_size is
    larger, so a busy tenant's aggregate never holds a shard's round robin for more than a
    turn; a tenant's record over that goes alone, raw, after the open aggregate."""
    agg = make_aggregator(
        predict=lambda h: "shard",
        max_size=51_200,
        container_key_from_records=container_key_from_records,
    )
    out: list[KinesisRecord] = []
    for i in range(40):
        record = _arrived(f"key-{i:03d}", 1, 1.0)
        record.tenant = "t"
        agg.put(record, out)
    assert out, "40 KB of a tenant's records fill more than one aggregate"
    assert all(kr.size <= FAIR_QUANTUM for kr in out)
    assert all(kr.tenant == "t" for kr in out)
    big = _arrived("big", 1, 1.1, size=20_000)
    big.tenant = "t"
    before = len(out)
    agg.put(big, out)
    assert [len(kr.records) for kr in out[before:]][-1] == 1
    assert out[-1].records == [big]  # alone, after the open aggregate (sealed first)
    assert agg.open_aggregates == 0
    # records without a tenant still fill up to aggregation_max_size
    plain_out: list[KinesisRecord] = []
    for i in range(45):
        agg.put(_arrived(f"plain-{i:03d}", 1, 1.2), plain_out)
    assert not plain_out
    agg.flush_all(plain_out)
    assert plain_out[0].size > FAIR_QUANTUM


def test_a_small_aggregation_max_size_applies_to_tenants_as_it_is() -> None:
    agg = make_aggregator(predict=lambda h: "shard", max_size=4_000)
    out: list[KinesisRecord] = []
    for i in range(3):
        record = _arrived(f"k{i}", 1, 1.0)
        record.tenant = "t"
        agg.put(record, out)
    agg.flush_all(out)
    assert [len(kr.records) for kr in out] == [3]


def test_a_tenants_aggregate_about_to_fill_keeps_gathering_against_its_own_limit() -> None:
    """The fill horizon of adaptive batching measures an aggregate against its own limit: a
    tenant's 16 KiB aggregate a kilobyte short of it, filling at a kilobyte a millisecond,
    keeps gathering, as a 50 KiB one of records without a tenant does."""
    for tenant, count in ((None, 48), ("t", 15)):
        agg = make_aggregator(predict=lambda h: "shard", max_size=51_200)
        out: list[KinesisRecord] = []
        for i in range(count):
            record = _arrived(f"k{i}", 1, i * 0.001)
            record.tenant = tenant
            agg.put(record, out)
        assert not out
        assert agg.seal_all(out, frozenset(), now=count * 0.001, horizon=0.025), tenant
        assert not out


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("map_unavailable", [False, True])
@pytest.mark.parametrize("max_count", [4, 4294967295])
def test_a_run_of_a_shards_records_goes_as_its_records_one_by_one(
    enabled: bool, map_unavailable: bool, max_count: int
) -> None:
    # Aggregator.put_run (a batch's records of one shard, one deadline, under the key cache's
    # facts) seals and keeps what put_placed record by record does: aggregation on or off, the
    # map found missing for good, aggregates sealed by size and by count, an aggregate open
    # from before with an earlier deadline
    def run(in_one_call: bool) -> tuple[list[object], list[object], bool]:
        aggregator = make_aggregator(enabled=enabled, max_size=300, max_count=max_count)
        aggregator.map_unavailable = map_unavailable
        keys = {
            f"k{n % 5}": _wire.KeyFacts(f"k{n % 5}", 0, 2, _wire.key_table_entry(b"k%d" % (n % 5)))
            for n in range(5)
        }
        out: list[KinesisRecord] = []
        earlier = make_record("k0", b"e" * 10, deadline=0.5)
        earlier.key_facts = keys["k0"]
        earlier.predicted_shard = SHARD
        moved = aggregator.put_placed(earlier, out)
        records = []
        for n in range(40):
            record = make_record(f"k{n % 5}", b"%02d" % n + b"x" * (n % 7) * 9)
            record.key_facts = keys[f"k{n % 5}"]
            record.size = len(record.data) + 2
            record.predicted_shard = SHARD
            records.append(record)
        if in_one_call:
            moved |= aggregator.put_run(SHARD, records, out)
        else:
            for record in records:
                moved |= aggregator.put_placed(record, out)
        sealed = [(len(kr.records), kr.deadline, kr.data) for kr in out]
        held = sorted((len(a.records), a.deadline) for a in aggregator._open.values())
        return sealed, held, moved

    assert run(True) == run(False)
