"""One stream's Pipeline through its own API (``put``, ``flush``, ``start``, ``stop``, and
admission by ``admit``/``has_room``/``finish`` under the limit ``update_backlog_limit`` plans),
over a FakeKinesis, on asyncio and trio. The Producer's tests cover the same stages end to end;
these pin the pipeline's contract with the producer."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from anykpl._core import _limits
from anykpl._core._metrics import Metrics
from anykpl._core._records import Record
from anykpl._core._token_bucket import TokenBucket
from anykpl._runtime._pipeline import Pipeline
from anykpl.config import ProducerConfig

from .fakes import FakeKinesis, hash_of

pytestmark = pytest.mark.anyio

STREAM = "stream"


class Finished:
    """The producer's side of ``finish``: what the pipeline resolved, and an event once
    ``expected`` records are terminal."""

    def __init__(self, expected: int) -> None:
        self.records: list[tuple[Record, bool]] = []
        self.expected = expected
        self.all_done = anyio.Event()

    def __call__(self, records: Sequence[Record], success: bool) -> tuple[int, int]:
        self.records.extend((record, success) for record in records)
        if len(self.records) >= self.expected:
            self.all_done.set()
        return len(records), sum(record.size for record in records)


def pipeline_for(
    fake: FakeKinesis, finished: Callable[..., tuple[int, int]], **options: Any
) -> Pipeline:
    config = ProducerConfig(retry_backoff_initial=0.001, retry_backoff_max=0.01, **options)
    return Pipeline(STREAM, config, fake, Metrics(), finished)


def record(pipeline: Pipeline, key: str, data: bytes) -> Record:
    """A record as the producer admits it: stamped now, counted, then put."""
    now = anyio.current_time()
    config = pipeline.config
    size = len(data) + len(key)
    pending = Record(
        STREAM,
        key,
        data,
        hash_of(key),
        None,
        now,
        now + config.record_max_buffered_time,
        now + config.record_ttl,
        size,
    )
    pipeline.admit(size)
    pipeline.put(pending)
    return pending


async def guard(stage: Callable[[], Any]) -> None:
    await stage()


@asynccontextmanager
async def running(pipeline: Pipeline) -> AsyncIterator[Pipeline]:
    """The pipeline's stages running in a task group; stopped on the way out (which is also
    what closes the streams between them)."""
    async with anyio.create_task_group() as tg:
        pipeline.start(tg, guard)
        try:
            yield pipeline
        finally:
            pipeline.stop()


async def test_a_started_pipeline_delivers_every_record_and_finishes_each_once() -> None:
    fake = FakeKinesis()
    finished = Finished(200)
    pipeline = pipeline_for(fake, finished, record_max_buffered_time=0.01)
    async with anyio.create_task_group() as tg:
        pipeline.start(tg, guard)
        sent = [record(pipeline, f"key-{i}", b"%d" % i) for i in range(200)]
        assert pipeline.outstanding_records == 200
        with anyio.fail_after(5):
            await finished.all_done.wait()
        pipeline.stop()
    assert sorted(r.data for r in fake.user_records()) == sorted(r.data for r in sent)
    assert {id(r) for r, _ in finished.records} == {id(r) for r in sent}
    assert len(finished.records) == 200
    assert all(success for _, success in finished.records)
    assert all(r.shard_id is not None and r.sequence_number is not None for r in sent)
    # finish gave every record's room back
    assert (pipeline.outstanding_records, pipeline.outstanding_bytes) == (0, 0)
    # aggregated: far fewer Kinesis records than user records went out
    assert sum(len(request) for request in fake.requests) < 50


async def test_flush_sends_what_the_stages_hold_before_their_deadlines() -> None:
    fake = FakeKinesis()
    finished = Finished(3)
    # an hour of buffering: only the flush marker can make these records go
    pipeline = pipeline_for(fake, finished, record_max_buffered_time=3600.0)
    async with anyio.create_task_group() as tg:
        pipeline.start(tg, guard)
        for i in range(3):
            record(pipeline, f"key-{i}", b"x%d" % i)
        pipeline.flush()
        with anyio.fail_after(5):
            await finished.all_done.wait()
        pipeline.stop()
    assert sorted(r.data for r in fake.user_records()) == [b"x0", b"x1", b"x2"]


@pytest.mark.autojump
async def test_records_are_held_until_their_deadline_or_a_flush() -> None:
    fake = FakeKinesis()
    finished = Finished(2)
    pipeline = pipeline_for(
        fake,
        finished,
        record_max_buffered_time=60.0,
        record_ttl=600.0,
        adaptive_batching=False,  # the KPL's batching
    )
    async with anyio.create_task_group() as tg:
        pipeline.start(tg, guard)
        started = anyio.current_time()
        record(pipeline, "key", b"held")
        await anyio.sleep(59.0)  # virtual time: the autojump clock
        assert fake.requests == []
        with anyio.fail_after(2):
            while not finished.records:  # noqa: ASYNC110 (the pipeline's tasks)
                await anyio.sleep(0.1)
        # sent at its deadline (the collector may wait as long again for more records)
        assert 60.0 <= anyio.current_time() - started <= 121.0
        record(pipeline, "other", b"flushed")
        pipeline.flush()
        with anyio.fail_after(1):  # long before another deadline
            await finished.all_done.wait()
        pipeline.stop()
    assert sorted(r.data for r in fake.user_records()) == [b"flushed", b"held"]


async def _map_ready(pipeline: Pipeline) -> None:
    while not pipeline.shard_map.ready:  # noqa: ASYNC110 (the shard map's task)
        await anyio.sleep(0.001)


@pytest.mark.autojump
async def test_with_nothing_in_flight_records_go_at_once_and_gather_while_one_is() -> None:
    """Adaptive batching (Nagle's rule): a record that finds nothing in flight goes at once,
    whatever its deadline; records that come while that request is in flight gather, one
    aggregate per shard, and go together the moment it returns."""
    fake = FakeKinesis()
    fake.delay = 1.0  # a second's round trip (virtual time)
    finished = Finished(41)
    pipeline = pipeline_for(fake, finished, record_max_buffered_time=60.0, record_ttl=600.0)
    async with anyio.create_task_group() as tg:
        pipeline.start(tg, guard)
        await _map_ready(pipeline)
        started = anyio.current_time()
        record(pipeline, "first", b"alone")
        await anyio.sleep(0.01)
        assert [[entry["Data"] for entry in request] for request in fake.requests] == [[b"alone"]]
        for i in range(40):  # while it is in flight
            record(pipeline, f"k{i}", b"%d" % i)
            await anyio.sleep(0.01)
        assert len(fake.requests) == 1
        with anyio.fail_after(5):
            await finished.all_done.wait()
        # the second request left when the first returned (1 s), not at a deadline (60 s)
        assert anyio.current_time() - started < 2.5
        assert len(fake.requests) == 2
        second = fake.requests[1]
        assert len(second) <= 4  # aggregated: one Kinesis record per shard
        pipeline.stop()
    assert sorted(r.data for r in fake.user_records()) == sorted(
        [b"alone", *(b"%d" % i for i in range(40))]
    )


@pytest.mark.autojump
@pytest.mark.parametrize(
    ("every", "firehose"), [(0.0005, True), (0.01, False)], ids=["firehose", "trickle"]
)
async def test_a_firehose_request_lingers_and_a_trickle_goes_at_once(
    every: float, firehose: bool
) -> None:
    """An endpoint that answers in a millisecond (virtual time). A firehose (records of
    25,000 B every 0.5 ms, 50 MB/s) sends a request each time the one in flight returns no
    more: its requests linger up to the fill horizon (25 ms), so a tenth of a second takes a
    handful of requests, not one per round trip. A trickle (one every 10 ms) still goes at
    once."""
    fake = FakeKinesis()
    fake.delay = 0.001
    count = 200 if firehose else 20
    finished = Finished(count)
    pipeline = pipeline_for(
        fake, finished, record_max_buffered_time=0.1, record_ttl=600.0, rate_limit=1e9
    )
    async with anyio.create_task_group() as tg:
        pipeline.start(tg, guard)
        await _map_ready(pipeline)
        started = anyio.current_time()
        for i in range(count):
            record(pipeline, f"key-{i}", bytes(25_000))
            await anyio.sleep(every)
        with anyio.fail_after(5):
            await finished.all_done.wait()
        took = anyio.current_time() - started
        pipeline.stop()
    waits = [r.last_attempt.start - r.arrival for r, _ in finished.records if r.last_attempt]
    if firehose:
        # 0.1 s of records: a few short requests while the pace is first measured, then one
        # per fill horizon (25 ms) or per shard's 256 KiB (without lingering: 85 requests)
        assert len(fake.requests) <= 16, [len(request) for request in fake.requests]
        # lingering never takes a record past its deadline: record_max_buffered_time after
        # its admission, extended to 20 ms after it reached the Collector (as in the KPL)
        assert max(waits) <= 0.1 + 0.02
        assert took <= 0.1 + 0.1 + 0.02
    else:
        # a request per record or two, each sent within a round trip of its admission
        assert len(fake.requests) >= count - 2
        assert max(waits) < 0.003


@pytest.mark.autojump
async def test_records_behind_a_record_waiting_for_tokens_keep_gathering() -> None:
    """A stream whose Limiter holds records for tokens is not idle: records that come
    meanwhile gather in their aggregate (sending them early would only spend the shard's
    record tokens), and go once a request returns with nothing left waiting for tokens."""
    fake = FakeKinesis(shard_count=1)
    finished = Finished(3)
    pipeline = pipeline_for(
        fake, finished, record_max_buffered_time=5.0, record_ttl=600.0, rate_limit=1
    )
    big = b"x" * 4000
    async with anyio.create_task_group() as tg:
        pipeline.start(tg, guard)
        await _map_ready(pipeline)
        # 1 % of 1 MiB/s: about 10 KB of byte tokens a second, half a second's at start
        record(pipeline, "a", big)
        await anyio.sleep(0.01)
        assert len(fake.requests) == 1
        record(pipeline, "b", big)  # sealed at once (idle), then waits for its tokens
        await anyio.sleep(0.01)
        assert pipeline.limiter.queued == 1
        record(pipeline, "c", b"gathers")  # not idle: waits in its aggregate
        await anyio.sleep(0.1)
        assert pipeline.limiter.queued == 1
        assert pipeline.aggregator.open_aggregates == 1
        assert len(fake.requests) == 1
        with anyio.fail_after(30):
            await finished.all_done.wait()
        pipeline.stop()
    assert sorted(r.data for r in fake.user_records()) == [b"gathers", big, big]


async def test_stop_ends_every_stage_and_the_task_group_exits() -> None:
    fake = FakeKinesis()
    pipeline = pipeline_for(fake, Finished(1))
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            pipeline.start(tg, guard)
            while not pipeline.shard_map.ready:  # noqa: ASYNC110 (the shard map's task)
                await anyio.sleep(0.001)
            assert not pipeline.stopped
            pipeline.stop()
    assert pipeline.stopped


async def test_stop_before_start_ends_the_stages_at_once() -> None:
    fake = FakeKinesis()
    pipeline = pipeline_for(fake, Finished(1))
    pipeline.stop()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            pipeline.start(tg, guard)
    assert pipeline.stopped
    assert fake.requests == []


async def test_the_backlog_limit_starts_at_one_shards_ceiling_for_max_outstanding_time() -> None:
    pipeline = pipeline_for(
        FakeKinesis(), Finished(1), aggregation_enabled=False, max_outstanding_time=0.01
    )
    async with running(pipeline):
        # 10 ms of one shard: 10 records, 10 KiB (the shard map is not ready yet)
        assert pipeline.backlog_records == pytest.approx(_limits.SHARD_RECORDS_PER_SECOND * 0.01)
        assert pipeline.backlog_bytes == pytest.approx(_limits.SHARD_BYTES_PER_SECOND * 0.01)
        for _ in range(10):
            assert pipeline.has_room(100)
            pipeline.admit(100)
        assert not pipeline.has_room(100)  # the eleventh record waits
        assert (pipeline.outstanding_records, pipeline.outstanding_bytes) == (10, 1000)


async def test_finish_gives_room_back() -> None:
    finished = Finished(1)
    pipeline = pipeline_for(
        FakeKinesis(), finished, aggregation_enabled=False, max_outstanding_time=0.01
    )
    async with running(pipeline):
        held = [record(pipeline, f"k{i}", b"x" * 98) for i in range(10)]
        assert not pipeline.has_room(100)
        pipeline.finish(held[:1], True)
        assert pipeline.has_room(100)
        assert (pipeline.outstanding_records, pipeline.outstanding_bytes) == (9, 900)
        assert finished.records == [(held[0], True)]


async def test_an_empty_stream_takes_one_record_of_any_size() -> None:
    pipeline = pipeline_for(
        FakeKinesis(), Finished(1), aggregation_enabled=False, max_outstanding_time=0.01
    )
    async with running(pipeline):
        too_big = _limits.SHARD_BYTES_PER_SECOND  # a second of the shard: 100 times the limit
        assert pipeline.has_room(too_big)
        pipeline.admit(too_big)
        assert not pipeline.has_room(1)


async def test_the_backlog_limit_counts_only_bytes_until_the_aggregation_ratio_is_known() -> None:
    pipeline = pipeline_for(FakeKinesis(), Finished(1), max_outstanding_time=0.01)
    async with running(pipeline):
        assert pipeline.backlog_records == float("inf")
        assert pipeline.backlog_bytes == pytest.approx(_limits.SHARD_BYTES_PER_SECOND * 0.01)


async def test_the_backlog_time_defaults_to_half_the_record_ttl() -> None:
    pipeline = pipeline_for(FakeKinesis(), Finished(1), aggregation_enabled=False, record_ttl=0.2)
    async with running(pipeline):
        assert pipeline.backlog_records == pytest.approx(_limits.SHARD_RECORDS_PER_SECOND * 0.1)


async def test_the_backlog_limit_is_planned_again_at_most_every_quarter_second() -> None:
    pipeline = pipeline_for(
        FakeKinesis(), Finished(1), aggregation_enabled=False, max_outstanding_time=0.01
    )
    async with running(pipeline):
        calls: list[None] = []
        pipeline.on_room = lambda: calls.append(None)
        now = anyio.current_time()
        pipeline.update_backlog_limit(now)
        planned = pipeline.backlog_records
        pipeline.backlog_records = 1.0  # as if planned low: only a new plan raises it again
        pipeline.update_backlog_limit(now + 0.1)
        assert pipeline.backlog_records == 1.0
        assert calls == []
        pipeline.update_backlog_limit(now + 0.3)
        assert pipeline.backlog_records == planned
        assert calls == [None]  # it grew: the producer's waiters are woken


async def test_each_shard_has_its_own_backlog_limit_and_a_fleet_grant_bounds_them_together() -> (
    None
):
    fake = FakeKinesis()  # 4 shards
    finished = Finished(1)
    pipeline = pipeline_for(fake, finished, aggregation_enabled=False, max_outstanding_time=2.0)
    async with running(pipeline):
        record(pipeline, "warm-up", b"w")
        with anyio.fail_after(5):
            await finished.all_done.wait()
        for shard in fake.shards:  # a record's backlog for each shard
            pending = Record(STREAM, "k", b"x", shard.start, None, 0.0, 0.0, 0.0)
            pipeline.intake.place(pending)
        now = anyio.current_time() + 1.0
        pipeline.update_backlog_limit(now)
        backlogs = pipeline.intake.backlogs
        assert len(backlogs) == 4
        for backlog in backlogs.values():  # 2 s of each shard's own 1 MiB/s
            assert backlog.limit_bytes == pytest.approx(2 * _limits.SHARD_BYTES_PER_SECOND)
        # the stream's limit (records whose shard is not known) is all four shards together
        assert pipeline.backlog_bytes == pytest.approx(8 * _limits.SHARD_BYTES_PER_SECOND)

    shared = TokenBucket(1e15, 100_000.0, 0.0)  # a fleet grant of 100 KB/s for the producer
    finished = Finished(1)
    fleet = Pipeline(
        STREAM,
        ProducerConfig(aggregation_enabled=False, max_outstanding_time=2.0),
        fake,
        Metrics(),
        finished,
        shared_bucket=shared,
    )
    async with running(fleet):
        record(fleet, "warm-up", b"w")
        with anyio.fail_after(5):
            await finished.all_done.wait()
        for shard in fake.shards:
            fleet.intake.place(Record(STREAM, "k", b"x", shard.start, None, 0.0, 0.0, 0.0))
        fleet.update_backlog_limit(anyio.current_time() + 1.0)
        # the grant split over the shards (each was bounded by the whole grant, four times it)
        total = sum(backlog.limit_bytes for backlog in fleet.intake.backlogs.values())
        assert total == pytest.approx(2 * 100_000.0)
        assert fleet.backlog_bytes == pytest.approx(2 * 100_000.0)
