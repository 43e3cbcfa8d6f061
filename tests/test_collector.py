"""The Collector: Kinesis records → PutRecords requests (pure, virtual time)."""

from __future__ import annotations

import math

import pytest

from anykpl._core import _limits
from anykpl._core._collector import Collector
from anykpl._core._records import KinesisRecord, Record


def make_kinesis_record(
    *,
    shard: str | None = "shardId-000000000000",
    size: int = 10,
    deadline: float = 1.0,
    expiration: float = 30.0,
) -> KinesisRecord:
    data = bytes(size - 1)
    user = Record("stream", "k", data, 1, None, 0.0, deadline, expiration)
    return KinesisRecord([user], data, "k", "1", shard, deadline, expiration)


def make_collector(
    *,
    max_count: int = 500,
    max_size: int = 5 * 1024 * 1024,
    record_max_buffered_time: float = 0.1,
    extend_deadlines: bool = True,
) -> Collector:
    return Collector(
        max_count=max_count,
        max_size=max_size,
        record_max_buffered_time=record_max_buffered_time,
        extend_deadlines=extend_deadlines,
    )


def _shards(count: int) -> list[str]:
    return [f"shardId-{i:012d}" for i in range(count)]


def test_at_most_500_records_per_request() -> None:
    collector = make_collector()
    shards = _shards(50)
    records = [make_kinesis_record(shard=shards[i % 50]) for i in range(1200)]
    out: list[list[KinesisRecord]] = []
    collector.put(records, 0.0, out)
    assert [len(request) for request in out] == [500, 500]
    assert len(collector) == 200
    collector.flush(out)
    assert [len(request) for request in out] == [500, 500, 200]
    assert [kr for request in out for kr in request] == records
    assert len(collector) == 0
    assert collector.deadline == math.inf


def test_count_limit_is_configurable() -> None:
    collector = make_collector(max_count=3)
    out: list[list[KinesisRecord]] = []
    collector.put([make_kinesis_record(shard=s) for s in _shards(7)], 0.0, out)
    assert [len(request) for request in out] == [3, 3]


def test_requests_never_exceed_collection_max_size() -> None:
    max_size = 1024 * 1024
    collector = make_collector(max_size=max_size)
    sizes = [100_000, 250_000, 70_000, 200_000, 240_000, 199_000, 1_000, 90_000] * 4
    shards = _shards(len(sizes))  # one shard each: no per-shard trigger
    records = [make_kinesis_record(size=n, shard=s) for n, s in zip(sizes, shards, strict=True)]
    out: list[list[KinesisRecord]] = []
    collector.put(records, 0.0, out)
    collector.flush(out)
    assert len(out) > 1
    for request in out:
        assert sum(kr.size for kr in request) <= max_size
    assert [kr for request in out for kr in request] == records


def test_request_is_sent_when_it_reaches_the_size_limit_exactly() -> None:
    collector = make_collector(max_size=60_000)
    out: list[list[KinesisRecord]] = []
    shards = _shards(2)
    collector.put([make_kinesis_record(size=30_000, shard=s) for s in shards], 0.0, out)
    assert [len(request) for request in out] == [2]
    assert len(collector) == 0


def test_a_record_bigger_than_the_request_limit_goes_alone() -> None:
    collector = make_collector(max_size=60_000)
    small = make_kinesis_record(size=10, shard="s1")
    big = make_kinesis_record(size=70_000, shard="s2")
    out: list[list[KinesisRecord]] = []
    collector.put([small, big], 0.0, out)
    assert out == [[small], [big]]


def test_per_shard_256_kib_trigger() -> None:
    collector = make_collector()
    out: list[list[KinesisRecord]] = []
    # 100 KiB into each of three shards: no shard has 256 KiB yet
    a, b, c = _shards(3)
    chunk = 100 * 1024
    collector.put([make_kinesis_record(size=chunk, shard=s) for s in (a, b, c)], 0.0, out)
    assert out == []
    collector.put([make_kinesis_record(size=chunk, shard=s) for s in (a, b)], 0.0, out)
    assert out == []
    # the third 100 KiB on shard a takes it over 256 KiB: the request goes out
    collector.put([make_kinesis_record(size=chunk, shard=a)], 0.0, out)
    assert len(out) == 1
    assert len(out[0]) == 6
    assert len(collector) == 0
    # the per-shard totals start over with the next request
    collector.put([make_kinesis_record(size=chunk, shard=a) for _ in range(2)], 0.0, out)
    assert len(out) == 1


def test_per_shard_trigger_at_exactly_256_kib() -> None:
    collector = make_collector()
    out: list[list[KinesisRecord]] = []
    half = _limits.COLLECTOR_SHARD_FLUSH_BYTES // 2
    collector.put([make_kinesis_record(size=half)], 0.0, out)
    assert out == []
    collector.put([make_kinesis_record(size=half)], 0.0, out)
    assert len(out) == 1


@pytest.mark.parametrize(
    ("rmbt", "extension"), [(0.1, 0.02), (0.25, 0.05), (1.0, 0.05), (0.0, 0.0), (0.01, 0.002)]
)
def test_deadline_extension_is_min_of_50ms_and_a_fifth_of_rmbt(
    rmbt: float, extension: float
) -> None:
    collector = make_collector(record_max_buffered_time=rmbt)
    assert collector.extension == pytest.approx(extension)
    out: list[list[KinesisRecord]] = []
    # a record that spent its whole buffer time in the aggregator
    collector.put([make_kinesis_record(deadline=9.0)], 10.0, out)
    assert collector.deadline == pytest.approx(10.0 + extension)
    collector.flush_due(10.0 + extension * 0.99, out)
    assert out == [] or extension == 0.0
    collector.flush_due(10.0 + extension, out)
    assert len(out) == 1


def test_extension_does_not_shorten_a_later_deadline() -> None:
    collector = make_collector(record_max_buffered_time=0.1)
    out: list[list[KinesisRecord]] = []
    collector.put([make_kinesis_record(deadline=12.0)], 10.0, out)
    assert collector.deadline == 12.0


def test_extension_is_clamped_to_the_expiration() -> None:
    collector = make_collector(record_max_buffered_time=1.0)
    out: list[list[KinesisRecord]] = []
    collector.put([make_kinesis_record(deadline=9.0, expiration=10.01)], 10.0, out)
    assert collector.deadline == pytest.approx(10.01)


def test_no_extension_when_aggregation_is_off() -> None:
    collector = make_collector(record_max_buffered_time=1.0, extend_deadlines=False)
    assert collector.extension == 0.0
    out: list[list[KinesisRecord]] = []
    collector.put([make_kinesis_record(deadline=9.0)], 10.0, out)
    assert collector.deadline <= 10.0  # due at once
    collector.flush_due(10.0, out)
    assert len(out) == 1


def test_request_deadline_is_the_earliest_of_its_records() -> None:
    collector = make_collector(extend_deadlines=False)
    out: list[list[KinesisRecord]] = []
    collector.put(
        [
            make_kinesis_record(deadline=d, shard=s)
            for d, s in zip((5.0, 3.0, 4.0), _shards(3), strict=True)
        ],
        0.0,
        out,
    )
    assert collector.deadline == 3.0
    collector.flush_due(2.9, out)
    assert out == []
    collector.flush_due(3.0, out)
    assert len(out) == 1
    assert len(out[0]) == 3


def test_flush_of_an_empty_collector_sends_nothing() -> None:
    collector = make_collector()
    out: list[list[KinesisRecord]] = []
    collector.flush(out)
    collector.flush_due(100.0, out)
    assert out == []


# -- lingering: a firehose's request gathers a little longer (adaptive batching) -----------

HORIZON = 0.025  # the fill horizon: a quarter of record_max_buffered_time 0.1
AGGREGATE = 51_200  # aggregation_max_size: two full ones within the horizon, a firehose's pace


def _stream_in(
    collector: Collector, out: list[list[KinesisRecord]], start: float, every: float, count: int
) -> float:
    """``count`` aggregates of 50,000 B, one every ``every`` seconds from ``start`` (on eight
    shards in turn); the time of the last."""
    now = start
    for n in range(count):
        now = start + n * every
        shard = f"shardId-{n % 8:012d}"
        collector.put([make_kinesis_record(size=50_000, shard=shard, deadline=now + 0.1)], now, out)
    return now


def test_a_firehose_request_lingers_until_the_horizon_after_its_first_record() -> None:
    collector = make_collector()
    out: list[list[KinesisRecord]] = []
    last = _stream_in(collector, out, 10.0, 0.001, 5)  # 50 MB/s
    assert out == []
    assert collector.linger(last, HORIZON, AGGREGATE)
    # if nothing more comes, it goes about four mean gaps (1 ms each) after its latest record
    assert last + 0.002 < collector.deadline < last + 0.008
    # more keeps coming: it keeps gathering, up to the horizon after its first record
    last = _stream_in(collector, out, last + 0.001, 0.001, 20)
    assert out == []
    assert collector.linger(last, HORIZON, AGGREGATE)
    assert collector.deadline == pytest.approx(10.0 + HORIZON)
    collector.flush_due(10.0 + HORIZON - 0.0001, out)
    assert out == []
    collector.flush_due(10.0 + HORIZON, out)
    assert len(out) == 1
    assert len(out[0]) == 25
    # and the horizon is the end of lingering
    _stream_in(collector, out, 10.026, 0.001, 26)
    assert not collector.linger(10.026 + HORIZON + 0.0001, HORIZON, AGGREGATE)


def test_a_request_lingers_no_longer_than_its_records_deadlines() -> None:
    collector = make_collector(extend_deadlines=False)
    out: list[list[KinesisRecord]] = []
    collector.put([make_kinesis_record(size=50_000, deadline=9.9925)], 9.99, out)
    collector.put([make_kinesis_record(size=50_000, deadline=10.05)], 9.991, out)
    # lingering would last until 9.995 (four 1 ms gaps after the latest record)
    assert collector.linger(9.991, HORIZON, AGGREGATE)
    assert collector.deadline == 9.9925


def test_a_slow_stream_does_not_linger() -> None:
    """Below the firehose pace (two aggregates per horizon), nothing lingers: a service's
    records go at once when nothing is in flight, as adaptive batching promises."""
    collector = make_collector()
    out: list[list[KinesisRecord]] = []
    last = _stream_in(collector, out, 10.0, 0.015, 3)  # 3.3 MB/s
    assert not collector.linger(last, HORIZON, AGGREGATE)
    assert collector.deadline == pytest.approx(10.1)  # its first record's


def test_lingering_ends_once_the_records_stop_coming() -> None:
    collector = make_collector()
    out: list[list[KinesisRecord]] = []
    last = _stream_in(collector, out, 10.0, 0.001, 5)
    assert not collector.linger(last + 0.012, HORIZON, AGGREGATE)  # four gaps have passed
    assert not collector.linger(10.0 + HORIZON, HORIZON, AGGREGATE)  # the horizon has passed


def test_a_lingering_request_still_goes_at_a_limit() -> None:
    collector = make_collector(max_count=10)
    out: list[list[KinesisRecord]] = []
    last = _stream_in(collector, out, 10.0, 0.0001, 9)
    assert collector.linger(last, HORIZON, AGGREGATE)
    _stream_in(collector, out, last + 0.0001, 0.0001, 1)
    assert len(out) == 1
    assert len(out[0]) == 10
    assert collector.deadline == math.inf  # the next request has nothing yet


def test_a_fast_stream_of_small_aggregates_does_not_linger() -> None:
    """A busy service's records go in the small aggregates its round trips seal (what came
    while the last request was in flight): however fast they come, they go at once."""
    collector = make_collector()
    out: list[list[KinesisRecord]] = []
    now = 10.0
    for n in range(40):
        now = 10.0 + n * 0.0001
        collector.put([make_kinesis_record(size=20_000, deadline=now + 0.1)], now, out)
    assert collector.pace(now) * HORIZON > 2 * AGGREGATE
    assert not collector.linger(now, HORIZON, AGGREGATE)


def test_an_empty_collector_does_not_linger() -> None:
    assert not make_collector().linger(1.0, HORIZON, AGGREGATE)
