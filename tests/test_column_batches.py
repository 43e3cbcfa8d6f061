"""A ``submit_many`` batch of ``(data, partition_key)`` kept in columns (``Intake.admit_columns``):
no record made per item unless a handle is asked for or a Kinesis record carrying items takes
another way than success. Through the public API over the fake transport, on both backends;
the intake's counts against the general path's, without an event loop. (Against real
endpoints: ``tests/integration/test_columns.py``, ``test_interop.py`` and ``test_end_to_end.py``.)
"""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import anyio
import pytest

from anykpl import BatchResult, Producer, errors
from anykpl._core._intake import Intake, StreamIntake
from anykpl._core._records import AttemptRecord, BatchCounter, ColumnBatch, KinesisRecord
from anykpl._core._wire import deaggregate
from anykpl.metrics import MetricsReport

from .fakes import FakeKinesis, GatedKinesis, LateMapKinesis, hash_of
from .test_intake import _intake, _stream
from .test_metrics import RecordingSink
from .test_producer import FAST, STREAM, client_error, ready, stored

pytestmark = pytest.mark.anyio


def _items(n: int, keys: int = 37, start: int = 0) -> list[tuple[bytes, str]]:
    return [
        (b"item-%06d" % i + b"x" * (i % 50), f"key-{i % keys}") for i in range(start, start + n)
    ]


def _columns_admitted(producer: Producer) -> int:
    return len(producer._intake.column_batches)


def _where(fake: FakeKinesis) -> dict[tuple[str, str, int], bytes]:
    """Every user record the fake stored, by (shard, sequence number, subsequence number)."""
    return {
        (shard.shard_id, sequence, sub): user.data
        for shard in fake.shards
        for key, data, sequence in shard.records
        for sub, user in enumerate(deaggregate(data, key))
    }


def _check_where(batch: Any, fake: FakeKinesis) -> None:
    """Each succeeded handle of ``batch`` names the stored user record that holds its data."""
    where = _where(fake)
    failed = {position for position, _ in batch.result().failures}
    for position, handle in enumerate(batch):
        if position not in failed:
            result = handle.result()
            at = (result.shard_id, result.sequence_number, result.sub_sequence_number)
            assert where[at] == handle.data


async def test_a_batch_of_data_and_keys_makes_no_record_and_each_handle_says_where_it_went(
    fake_kinesis: FakeKinesis,
) -> None:
    items = _items(300)
    async with Producer(transport=fake_kinesis, **FAST) as producer:
        await ready(producer)
        before = _columns_admitted(producer)
        batch = await producer.submit_many(STREAM, items)
        assert _columns_admitted(producer) == before + 1
        assert producer.outstanding_records == 300
        columns = producer._intake.column_batches[-1]
        with anyio.fail_after(5):
            assert await batch == BatchResult(succeeded=300, failed=0, failures=())
        assert columns.records == [None] * 300  # no handle made: none asked for
        assert producer.outstanding_records == 0
    assert [handle.data for handle in batch] == [data for data, _ in items]
    assert [handle.partition_key for handle in batch] == [key for _, key in items]
    assert stored(fake_kinesis) == Counter(data for data, _ in items)
    _check_where(batch, fake_kinesis)
    # the items share aggregates (37 keys, 4 shards): none went alone
    aggregated = [data for shard in fake_kinesis.shards for _, data, _ in shard.records]
    assert len(aggregated) <= 5


async def test_a_handle_asked_for_while_pending_is_resolved_with_its_chunk() -> None:
    fake = GatedKinesis()
    async with Producer(transport=fake, **FAST) as producer:
        await ready(producer)
        fake.close_gate()
        batch = await producer.submit_many(STREAM, _items(40))
        early = batch[7]
        assert not early.done()
        assert fake.gate is not None
        fake.gate.set()
        with anyio.fail_after(5):
            result = await early
        await batch
    assert result.success
    assert batch[7] is early
    assert len(result.attempts) == 1
    _check_where(batch, fake)


async def test_items_that_fail_go_the_per_record_way_and_each_ends_once(
    fake_kinesis: FakeKinesis,
) -> None:
    """Whole requests failed, throttles and a terminal error per record: the Kinesis records'
    items go on as records; the retried ones are stored once, the terminal ones are listed in
    the batch's result by position, each handle says what happened to it."""
    doomed_shard = fake_kinesis.shards[1].shard_id
    throttles = [6]

    def entry_error(shard: str, index: int) -> tuple[str, str] | None:
        if shard == doomed_shard:
            return ("KMSAccessDeniedException", "no key")
        if throttles[0]:
            throttles[0] -= 1
            return ("ProvisionedThroughputExceededException", "slow down")
        return None

    items = _items(400)
    async with Producer(transport=fake_kinesis, record_ttl=30.0, **FAST) as producer:
        await ready(producer)
        fake_kinesis.request_errors = [client_error("InternalFailure", status=500)] * 2
        fake_kinesis.entry_error = entry_error
        before = _columns_admitted(producer)
        batches = [
            await producer.submit_many(STREAM, items[s : s + 100]) for s in range(0, 400, 100)
        ]
        assert _columns_admitted(producer) == before + 4
        with anyio.fail_after(5):
            outcomes = [await batch for batch in batches]
        assert producer.outstanding_records == 0
    failed = {
        batch[position].data: result
        for batch, outcome in zip(batches, outcomes, strict=True)
        for position, result in outcome.failures
    }
    assert all(r.attempts[-1].error_code == "KMSAccessDeniedException" for r in failed.values())
    assert all(r.shard_id is None for r in failed.values())
    assert 50 < len(failed) < 200  # about a quarter: the keys of one shard of four
    handles = [handle for batch in batches for handle in batch]
    for handle in handles:
        if handle.data in failed:
            with pytest.raises(errors.RecordFailedError):
                handle.result()
    assert stored(fake_kinesis) == Counter(d for d, _ in items if d not in failed)
    retried = [h for h in handles if h.data not in failed and len(h.result().attempts) > 1]
    assert retried  # the request errors and throttles hit the column items
    for batch in batches:
        _check_where(batch, fake_kinesis)


async def test_items_predicted_for_a_shard_that_split_go_where_the_stream_says(
    fake_kinesis: FakeKinesis,
) -> None:
    items = _items(200)
    async with Producer(transport=fake_kinesis, **FAST) as producer:
        await ready(producer)
        fake_kinesis.split(fake_kinesis.shards[0].shard_id)
        batch = await producer.submit_many(STREAM, items)
        with anyio.fail_after(5):
            assert (await batch).succeeded == 200
    # (an aggregate that straddles the children is put again: the copy a KCL reader drops
    # stays in the stream, as for records)
    assert set(stored(fake_kinesis)) == {data for data, _ in items}
    _check_where(batch, fake_kinesis)
    ranges = {shard.shard_id: (shard.start, shard.end) for shard in fake_kinesis.shards}
    for handle in batch:
        low, high = ranges[handle.result().shard_id]
        assert low <= hash_of(handle.partition_key) <= high  # the copy a KCL reader keeps
    assert {h.result().shard_id for h in batch} >= {
        fake_kinesis.shards[-1].shard_id,
        fake_kinesis.shards[-2].shard_id,
    }


async def test_closing_fails_a_column_batchs_unresolved_items_once() -> None:
    fake = GatedKinesis()
    outcomes: list[BatchResult] = []
    with anyio.fail_after(5):
        async with (
            anyio.create_task_group() as group,
            Producer(transport=fake, **{**FAST, "close_timeout": 0.1}) as producer,
        ):
            await ready(producer)
            fake.close_gate()
            batch = await producer.submit_many(STREAM, _items(60))
            early = batch[3]  # a handle made while pending

            async def wait_for_it() -> None:
                outcomes.append(await batch)

            group.start_soon(wait_for_it)
    assert [(o.succeeded, o.failed) for o in outcomes] == [(0, 60)]
    assert [position for position, _ in outcomes[0].failures] == list(range(60))
    assert early.done()
    with pytest.raises(errors.RecordFailedError):
        early.result()
    assert all(handle.done() for handle in batch)
    assert producer.outstanding_records == 0


async def test_flush_waits_for_column_batches_within_its_timeout() -> None:
    fake = GatedKinesis()
    async with Producer(transport=fake, **FAST) as producer:
        await ready(producer)
        fake.close_gate()
        batches = [await producer.submit_many(STREAM, _items(50, start=s)) for s in (0, 50)]
        with pytest.raises(errors.FlushTimeout, match="with 100 record"):
            await producer.flush(timeout=0.05)
        assert fake.gate is not None
        fake.gate.set()
        with anyio.fail_after(5):
            await producer.flush()
        assert all(batch.done() for batch in batches)


async def test_a_batch_that_does_not_fit_whole_goes_the_per_record_way() -> None:
    fake = GatedKinesis()
    async with Producer(
        transport=fake, max_outstanding_records=10, admission_timeout=0.1, **FAST
    ) as producer:
        await ready(producer)
        fake.close_gate()
        before = _columns_admitted(producer)
        with pytest.raises(errors.BackpressureTimeout) as caught:
            await producer.submit_many(STREAM, _items(15))
        assert _columns_admitted(producer) == before
        admitted = caught.value.admitted
        # as many as the cap and the reserve for quiet shards let in, in order
        assert 5 <= len(admitted) <= 10
        assert [h.data for h in admitted] == [d for d, _ in _items(len(admitted))]
        assert fake.gate is not None
        fake.gate.set()
        await producer.flush()
    assert stored(fake) == Counter(d for d, _ in _items(len(admitted)))


@pytest.mark.parametrize(
    "odd",
    [
        (b"odd", "k", "0"),  # an explicit hash key
        (bytearray(b"odd"), "k"),  # not bytes
        b"odd",  # a random key
        (b"x" * 1_048_000, "k"),  # too big to share an aggregate
    ],
    ids=["hash-key", "bytearray", "bare", "big"],
)
async def test_a_batch_with_an_item_of_another_kind_goes_the_per_record_way(
    fake_kinesis: FakeKinesis, odd: Any
) -> None:
    items: list[Any] = [*_items(20), odd]
    async with Producer(transport=fake_kinesis, **FAST) as producer:
        await ready(producer)
        before = _columns_admitted(producer)
        batch = await producer.submit_many(STREAM, items)
        assert _columns_admitted(producer) == before
        with anyio.fail_after(5):
            assert (await batch).succeeded == 21
    assert len(stored(fake_kinesis)) == 21


async def test_a_bad_item_among_pairs_is_named_and_nothing_is_admitted(
    fake_kinesis: FakeKinesis,
) -> None:
    async with Producer(transport=fake_kinesis, **FAST) as producer:
        await ready(producer)
        with pytest.raises(errors.InvalidRecordError, match=r"^records\[3\]: "):
            await producer.submit_many(STREAM, [*_items(3), (b"x", "")])
        assert producer.outstanding_records == 0
        assert producer._intake.outstanding_bytes == 0
    assert stored(fake_kinesis) == Counter()


async def test_one_item_alone_in_its_shard_goes_raw(fake_kinesis: FakeKinesis) -> None:
    """As one record alone does: a Kinesis record of one item is not an aggregate."""
    async with Producer(transport=fake_kinesis, **FAST) as producer:
        await ready(producer)
        before = _columns_admitted(producer)
        batch = await producer.submit_many(STREAM, [(b"alone", "one-key")])
        assert _columns_admitted(producer) == before + 1
        with anyio.fail_after(5):
            assert (await batch).succeeded == 1
    shard = next(s for s in fake_kinesis.shards if s.shard_id == batch[0].result().shard_id)
    assert ("one-key", b"alone", batch[0].result().sequence_number) in shard.records


# -- the intake's counts, without an event loop ------------------------------------------------


def _counts(intake: Intake, stream: StreamIntake) -> tuple[Any, ...]:
    return (
        len(intake.outstanding),
        intake.outstanding_bytes,
        intake.active_backlogs,
        stream.outstanding_records,
        stream.outstanding_bytes,
        stream.received,
        sorted(
            (b.shard, b.outstanding_records, b.outstanding_bytes)
            for b in stream.backlogs.values()
            if b.outstanding_records  # (a declined batch may leave a shard's empty backlog made)
        ),
    )


def test_a_column_batch_counts_in_and_out_as_its_records_would() -> None:
    """Admitting a batch in columns changes the intake's counts as admitting its records the
    general way does; its Kinesis records' items, in order of the shard's, are the records';
    their success counts every item out once."""
    items = _items(500, keys=61)
    general_sealed: list[KinesisRecord] = []
    column_sealed: list[KinesisRecord] = []
    general, columns = _intake(), _intake()
    general_stream = _stream(general, ship=general_sealed.extend)
    column_stream = _stream(columns, ship=column_sealed.extend)
    made = general.make_records("s", items, BatchCounter())
    assert general.admit_ready(general_stream, made, 0) == 500
    batch = columns.admit_columns(column_stream, "s", items)
    assert isinstance(batch, ColumnBatch)
    assert _counts(columns, column_stream) == _counts(general, general_stream)
    general_stream.aggregator.flush_all(general_sealed)
    column_stream.aggregator.flush_all(column_sealed)

    def by_shard(sealed: list[KinesisRecord]) -> dict[str | None, list[bytes]]:
        shards: dict[str | None, list[bytes]] = {}
        for kr in sealed:
            shards.setdefault(kr.predicted_shard, []).extend(
                user.data for user in deaggregate(kr.data, kr.partition_key)
            )
        return shards

    assert by_shard(column_sealed) == by_shard(general_sealed)
    assert all(kr.chunks is not None for kr in column_sealed)
    for kr in column_sealed:
        chunks = kr.chunks
        assert chunks is not None
        first = 0
        for owner, positions in chunks:
            owner.resolve_chunk(positions, str(kr.predicted_shard), "1", first, _attempt())
            first += len(positions)
        column_stream.finish_items(kr)
    general_stream.finish(made, True)
    assert _counts(columns, column_stream) == _counts(general, general_stream)
    assert batch.counter.remaining == 0
    assert batch.records == [None] * 500


def _succeed_all(stream: StreamIntake, sealed: list[KinesisRecord]) -> None:
    """Seal what is open and put every Kinesis record sealed so far, as the Retrier does."""
    stream.aggregator.flush_all(sealed)
    for kr in sealed:
        chunks = kr.chunks
        if chunks is None:
            stream.finish(kr.records, True)
            continue
        first = 0
        for owner, positions in chunks:
            owner.resolve_chunk(positions, str(kr.predicted_shard), "1", first, _attempt())
            first += len(positions)
        stream.finish_items(kr)
    sealed.clear()


@pytest.mark.parametrize(("max_records", "max_bytes"), [(300, 10**9), (10**6, 400_000)])
def test_a_column_batch_is_admitted_where_the_general_path_admits_all_of_it(
    max_records: int, max_bytes: int
) -> None:
    """Random batches offered to two intakes in step, one in columns (or, where it declines,
    the general way), one the general way: the batch is admitted in columns exactly where the
    general way admits all of it, and the counts stay the same; under each shard's limits,
    the producer's caps and reserve, and the network path's bound, now and then emptied."""
    rng = random.Random(11)
    sides = []
    for _ in range(2):
        intake = _intake(max_records, max_bytes)
        sealed: list[KinesisRecord] = []
        stream = _stream(intake, shard_records=30.5, shard_bytes=40_000.5, ship=sealed.extend)
        stream.path_share = 8_000.0
        sides.append((intake, stream, sealed))
    (general, general_stream, general_sealed), (columns, column_stream, column_sealed) = sides
    keys = [f"key-{n}" for n in range(9)]
    in_columns = declined = 0
    for step in range(600):
        path_bytes = 50_000.0 if step // 40 % 3 == 2 else math.inf
        general_stream.path_bytes = column_stream.path_bytes = path_bytes
        largest = 20 if step % 3 == 0 else 3_000
        items = [
            (b"%05d" % step + b"x" * rng.randrange(0, largest), rng.choice(keys))
            for _ in range(rng.randrange(1, 30))
        ]
        made = general.make_records("s", items, BatchCounter())
        admitted = general.admit_ready(general_stream, made, 0)
        batch = columns.admit_columns(column_stream, "s", items)
        assert (batch is not None) == (admitted == len(items)), step
        if batch is None:
            declined += 1
            made = columns.make_records("s", items, BatchCounter())
            assert columns.admit_ready(column_stream, made, 0) == admitted
        else:
            in_columns += 1
        assert _counts(columns, column_stream) == _counts(general, general_stream), step
        if step % 10 == 9:
            _succeed_all(general_stream, general_sealed)
            _succeed_all(column_stream, column_sealed)
            assert _counts(columns, column_stream) == _counts(general, general_stream), step
    assert in_columns > 100
    assert declined > 100


def test_a_column_batch_admits_all_or_nothing() -> None:
    intake = _intake(max_records=100)
    stream = _stream(intake)
    empty = _counts(intake, stream)
    assert intake.admit_columns(stream, "s", _items(101)) is None
    assert intake.admit_columns(stream, "s", [*_items(5), (b"x", "")]) is None
    assert intake.admit_columns(stream, "s", [*_items(5), [b"x", "k"]]) is None
    assert intake.admit_columns(stream, "s", []) is None
    assert _counts(intake, stream) == empty
    stream.shard_map.invalidate(1.0, None)
    assert intake.admit_columns(stream, "s", _items(5)) is None
    assert _counts(intake, stream) == empty


def test_a_chunk_resolves_each_item_once_however_it_was_taken() -> None:
    """Handles made before and after their chunk is resolved, and items taken over by the
    per-record path (closing) which their chunk, resolved later, leaves alone."""
    intake = _intake()
    stream = _stream(intake)
    batch = intake.admit_columns(stream, "s", _items(6, keys=1))
    assert batch is not None
    early = batch.handle(0)
    assert not early.done()
    taken = batch.take_unresolved()
    assert {record.data for record in taken} == {data for data, _ in _items(6, keys=1)}
    assert len(intake.outstanding) == 6
    for record in taken[3:]:  # the producer fails these three
        record.resolve(False)
    shard = str(taken[0].predicted_shard)
    batch.resolve_chunk([0, 1, 2, 3, 4, 5], shard, "9", 0, _attempt())
    assert not early.done()  # taken over: the per-record path resolves it, not its chunk
    assert batch.counter.remaining == 3
    assert batch.counter.failed == 3
    late = batch.handle(5)
    assert late is taken[5]
    assert late.done()


def _attempt() -> AttemptRecord:
    return AttemptRecord(0.0, 0.0, True, None, None)


class _SlowFinalReport(RecordingSink):
    """A metrics sink whose final report takes 0.2 s: the producer's stages still run
    meanwhile, after closing failed what was left."""

    async def publish(self, report: MetricsReport) -> None:
        if report.final:
            await anyio.sleep(0.2)
        await super().publish(report)


async def test_items_put_after_closing_failed_them_are_counted_out_once() -> None:
    fake = GatedKinesis()
    with anyio.fail_after(5):
        async with (
            anyio.create_task_group() as group,
            Producer(
                transport=fake,
                metrics_sinks=[_SlowFinalReport()],
                **{**FAST, "close_timeout": 0.1},
            ) as producer,
        ):
            await ready(producer)
            fake.close_gate()
            batch = await producer.submit_many(STREAM, _items(60, keys=7))
            await fake.entered.wait()

            async def answer_during_the_final_report() -> None:
                await anyio.sleep(0.15)  # the close's flush gave up at 0.1 s
                assert fake.gate is not None
                fake.gate.set()

            group.start_soon(answer_during_the_final_report)
    assert (batch.succeeded, batch.failed) == (0, 60)
    intake = producer._intake
    stream = producer._pipelines[STREAM].intake
    assert (len(intake.outstanding), intake.outstanding_bytes, intake.active_backlogs) == (0, 0, 0)
    assert (stream.outstanding_records, stream.outstanding_bytes) == (0, 0)
    assert {(b.outstanding_records, b.outstanding_bytes) for b in stream.backlogs.values()} == {
        (0, 0)
    }


async def test_submit_and_submit_many_taking_turns_on_a_shard_share_its_aggregates() -> None:
    fake = FakeKinesis(1)
    async with Producer(
        transport=fake, record_max_buffered_time=0.2, close_timeout=5.0
    ) as producer:
        await ready(producer)
        sent = len(fake.requests[-1])
        for i in range(100):
            await producer.submit(STREAM, b"one-%d" % i, partition_key=f"k{i % 5}")
            await producer.submit_many(STREAM, _items(10, keys=5, start=10 * i))
        await producer.flush()
    kinesis_records = sum(len(request) for request in fake.requests) - sent
    assert kinesis_records <= 3  # one aggregate, two if the deadline split them
    assert len(stored(fake)) == 1_100


async def test_finished_column_batches_are_not_kept_beyond_the_byte_cap(
    fake_kinesis: FakeKinesis,
) -> None:
    cap = 256 * 1024
    async with Producer(transport=fake_kinesis, max_outstanding_bytes=cap, **FAST) as producer:
        await ready(producer)
        for _ in range(20):
            batch = await producer.submit_many(
                STREAM, [(bytes(1000), f"k{i % 97}") for i in range(200)]
            )
            await batch
            for shard in fake_kinesis.shards:
                shard.records.clear()
        held = producer._intake.column_batches
        assert len(held) < 20
        assert sum(len(data) for batch in held for data in batch.datas) <= 2 * cap


async def test_a_streams_first_batch_waits_for_its_map_and_goes_in_columns(
    fake_kinesis: FakeKinesis,
) -> None:
    """The first submit_many of a stream opens its pipeline and waits for the shard map (one
    ListShards) rather than go record by record: it, and every batch after it, in columns."""
    async with Producer(transport=fake_kinesis, **FAST) as producer:
        batches = [await producer.submit_many(STREAM, _items(100, start=s)) for s in (0, 100)]
        assert _columns_admitted(producer) == 2
        assert len(fake_kinesis.list_shards_calls) == 1
        with anyio.fail_after(5):
            results = [await batch for batch in batches]
    assert results == [BatchResult(succeeded=100, failed=0, failures=())] * 2
    assert stored(fake_kinesis) == Counter(data for data, _ in _items(200))
    for batch in batches:
        _check_where(batch, fake_kinesis)


async def test_a_first_batch_whose_stream_has_no_map_fails_fast_record_by_record(
    fake_kinesis: FakeKinesis,
) -> None:
    fake_kinesis.list_shards_errors = [client_error("ResourceNotFoundException")] * 3
    fake_kinesis.request_errors = [client_error("ResourceNotFoundException")]
    async with Producer(transport=fake_kinesis, record_ttl=30.0, **FAST) as producer:
        batch = await producer.submit_many(STREAM, _items(20))
        assert _columns_admitted(producer) == 0
        with anyio.fail_after(5):
            result = await batch
    assert (result.succeeded, result.failed) == (0, 20)
    codes = {failed.attempts[-1].error_code for _, failed in result.failures}
    assert codes == {"ResourceNotFoundException"}


class _SlowMapKinesis(FakeKinesis):
    """A FakeKinesis whose ListShards answers only once ``answer`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = anyio.Event()

    async def list_shards(self, **kwargs: Any) -> Any:
        await self.answer.wait()
        return await super().list_shards(**kwargs)


async def test_a_first_batch_waits_for_the_map_no_longer_than_its_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ListShards that does not answer holds the stream's first batch FIRST_MAP_WAIT at
    most: then it goes record by record, and its records wait for the map as submit's do."""
    from anykpl._runtime import _producer

    monkeypatch.setattr(_producer, "FIRST_MAP_WAIT", 0.05)
    fake = _SlowMapKinesis()
    async with Producer(transport=fake, **FAST) as producer:
        with anyio.fail_after(5):
            batch = await producer.submit_many(STREAM, _items(30))
        assert _columns_admitted(producer) == 0
        assert producer.outstanding_records == 30
        assert not batch.done()
        fake.answer.set()
        with anyio.fail_after(5):
            assert await batch == BatchResult(succeeded=30, failed=0, failures=())
    _check_where(batch, fake)


async def test_a_column_batchs_lists_are_out_of_the_garbage_collector(
    fake_kinesis: FakeKinesis,
) -> None:
    """The lists a column batch and its aggregates make by the hundred (columns, positions,
    chunks, the builders' parts and key tables) hold bytes, numbers and KeyFacts only: the
    young collections do not walk them (untrack_list, on CPython)."""
    import gc
    import sys

    from anykpl._core._wire import AggregateBuilder, untrack_list

    assert (untrack_list is not None) is (sys.implementation.name == "cpython")
    if untrack_list is None:
        return
    builder = AggregateBuilder()
    assert not any(gc.is_tracked(part) for part in (builder._parts, builder._pk_table))
    async with Producer(transport=fake_kinesis, **FAST) as producer:
        await ready(producer)
        batch = await producer.submit_many(STREAM, _items(200))  # (in open aggregates)
        columns = producer._intake.column_batches[-1]
        lists = [columns.datas, columns.facts, columns.sizes, *columns.runs.values()]
        assert not any(gc.is_tracked(column) for column in lists)
        aggregates = list(producer._pipelines[STREAM].aggregator._open.values())
        assert aggregates
        for agg in aggregates:
            assert agg.items
            assert not any(gc.is_tracked(chunk) for _, chunk in agg.items)
            assert not gc.is_tracked(agg.builder._parts)
        with anyio.fail_after(5):
            await producer.flush()
        assert batch.done()


async def test_a_first_batch_waits_for_the_map_no_longer_than_admission_timeout() -> None:
    fake = _SlowMapKinesis()
    async with Producer(transport=fake, admission_timeout=0.05, **FAST) as producer:
        with anyio.fail_after(0.5):  # (FIRST_MAP_WAIT is 1 s)
            batch = await producer.submit_many(STREAM, _items(30))
        assert _columns_admitted(producer) == 0
        fake.answer.set()
        with anyio.fail_after(5):
            assert await batch == BatchResult(succeeded=30, failed=0, failures=())


async def test_a_bad_first_batch_raises_at_once_and_opens_no_pipeline() -> None:
    """Bad input raises before any wait for the map (found by review: a first item that is a
    pair made the batch open the stream's pipeline and wait before it raised)."""
    async with Producer(transport=LateMapKinesis(0.8), **FAST) as producer:
        with anyio.fail_after(0.3), pytest.raises(errors.InvalidRecordError):
            await producer.submit_many(STREAM, [(b"ok", "k"), (b"bad", "")])
        assert STREAM not in producer._pipelines


async def test_a_first_batch_waiting_for_its_map_when_close_begins_is_admitted() -> None:
    """Called before the close, the batch is admitted (record by record) and delivered by the
    close's flush, as it was before the wait existed; the close does not wait out the map's
    second (found by review: it was refused, a second late)."""
    fake = LateMapKinesis(0.3)
    outcome: list[BatchResult] = []
    async with Producer(transport=fake, **FAST) as producer:

        async def submitter() -> None:
            batch = await producer.submit_many(STREAM, _items(10))
            outcome.append(await batch)

        async with anyio.create_task_group() as tg:
            tg.start_soon(submitter)
            await anyio.sleep(0.01)  # (it waits for the map)
            assert producer._map_waits == 1
            with anyio.fail_after(2):
                await producer.aclose()
    assert outcome == [BatchResult(succeeded=10, failed=0, failures=())]
    assert stored(fake) == Counter(data for data, _ in _items(10))


async def test_a_first_batch_of_a_stream_pruned_while_it_waits_goes_on_at_once() -> None:
    fake = LateMapKinesis(0.5)
    async with Producer(transport=fake, stream_idle_timeout=0.05, **FAST) as producer:
        with anyio.fail_after(0.4):  # (the pruned pipeline's ListShards would answer later)
            batch = await producer.submit_many(STREAM, _items(10))
        with anyio.fail_after(5):
            assert await batch == BatchResult(succeeded=10, failed=0, failures=())
