"""The intake: its clock (the running backend's, read with as few calls as possible), and the
rule of admission per shard, driven without an event loop."""

from __future__ import annotations

import gc
import math
import random
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import pytest

from anykpl import Producer
from anykpl._compat import build_kind
from anykpl._core import _limits, _wire
from anykpl._core._aggregator import Aggregator
from anykpl._core._intake import (
    COMPACT_RECORDS,
    RESERVE,
    Intake,
    OutstandingRecords,
    StreamIntake,
    offset_clock,
)
from anykpl._core._records import BUILD_BY_STORES, BatchCounter, KinesisRecord, Record
from anykpl._core._shard_map import ShardMap
from anykpl._runtime._producer import _backend_clock

from .fakes import FakeKinesis, hash_of
from .fakes.kinesis import even_ranges

pytestmark = pytest.mark.anyio


def test_offset_clock_adds_the_offset_to_each_reading() -> None:
    readings = iter([1.0, 2.5])
    clock = offset_clock(lambda: next(readings), 100.0)
    assert (clock(), clock()) == (101.0, 102.5)


async def test_the_backend_clock_reads_the_backends_time() -> None:
    """The clock, and where it is a builtin plus an offset (trio's default clock), those two:
    each reads the backend's time."""
    clock, base, offset = _backend_clock()
    before = anyio.current_time()
    now = clock()
    split = now if base is None else base() + offset
    after = anyio.current_time()
    assert before <= now <= split <= after
    if base is not None:
        assert type(base).__name__ == "builtin_function_or_method"


async def test_admission_reads_the_clock_it_was_given() -> None:
    """A record's arrival is the producer's clock's time, also where admission reads that
    time as a builtin plus an offset."""
    async with Producer(transport=FakeKinesis(shard_count=2), rate_limit=1e9) as producer:
        before = anyio.current_time()
        records = [await producer.submit("s", b"x", partition_key="k") for _ in range(3)]
        after = anyio.current_time()
        await producer.flush()
    for record in records:
        assert isinstance(record, Record)
        assert before <= record.arrival <= after


@pytest.mark.autojump
async def test_under_a_mock_clock_the_backend_clock_follows_it() -> None:
    clock, base, _ = _backend_clock()
    assert base is None  # asked through trio
    start = clock()
    await anyio.sleep(30)  # no real time passes: the mock clock jumps
    assert clock() - start == pytest.approx(30, abs=1e-6)
    assert clock() == anyio.current_time()


def test_on_a_standard_asyncio_loop_the_clock_is_monotonic_itself() -> None:
    """The standard loops' ``time()`` is ``time.monotonic()``: called directly. A loop whose
    clock was replaced (a test's fake clock) is asked as it is."""
    import asyncio
    import time

    async def clocks() -> tuple[object, float]:
        standard = _backend_clock()[0]
        loop = asyncio.get_running_loop()
        loop.time = lambda: 12.5  # type: ignore[method-assign]
        return standard, _backend_clock()[0]()

    standard, replaced = asyncio.run(clocks())
    assert standard is time.monotonic
    assert replaced == 12.5


# -- admission per shard (pure: no event loop, the clock passed in) ---------------------------

SHARDS = 4


def _publish(shard_map: ShardMap, shards: int, first_id: int) -> None:
    """Publish a new map of ``shards`` even shards, numbered from ``first_id`` (a reshard)."""
    shard_map.begin_update()
    shard_map.apply_page(
        [
            {
                "ShardId": f"shardId-{first_id + i:012d}",
                "HashKeyRange": {"StartingHashKey": str(start), "EndingHashKey": str(end)},
            }
            for i, (start, end) in enumerate(even_ranges(shards))
        ]
    )
    shard_map.finish_update(0.0)


def _stream(
    intake: Intake,
    *,
    shard_records: float = math.inf,
    shard_bytes: float = math.inf,
    max_count: int = 4294967295,
    ship: Callable[[list[KinesisRecord]], object] = lambda sealed: None,
    wake: Callable[[], object] = lambda: None,
) -> StreamIntake:
    """A stream of SHARDS even shards whose map is READY, every shard's backlog limited to
    ``shard_records``/``shard_bytes``, and a limiter side that takes what is sealed."""
    shard_map = ShardMap()
    _publish(shard_map, SHARDS, 0)
    aggregator = Aggregator(
        enabled=True,
        max_size=_limits.DEFAULT_MAX_RECORD_SIZE,
        max_count=max_count,
        container_partition_key="a",
        predict=shard_map.shard_id,
    )
    stream = StreamIntake(
        intake.finish,
        aggregator,
        shard_map,
        max_buffered_time=0.1,
        record_ttl=30.0,
        backlog_time=15.0,
        ship=ship,
        wake=wake,
        request_refresh=lambda: None,
        finish_items=intake.finish_items,
    )
    stream.new_shard_records, stream.new_shard_bytes = shard_records, shard_bytes
    return stream


def _intake(max_records: int = 100_000, max_bytes: int = 128 * 1024 * 1024) -> Intake:
    return Intake(
        max_records, max_bytes, _limits.DEFAULT_MAX_RECORD_SIZE, lambda: 0.0, lambda: None
    )


def _key_on(shard: int, start: int = 0) -> str:
    """A partition key whose hash key falls in shard ``shard`` of SHARDS even shards."""
    low, high = even_ranges(SHARDS)[shard]
    for n in range(start, start + 100_000):
        key = f"key-{n}"
        if low <= hash_of(key) <= high:
            return key
    raise AssertionError("no key found")  # pragma: no cover


def _offer(intake: Intake, stream: StreamIntake, key: str, size: int = 1000) -> Record | None:
    """Admit one record for ``key`` if it fits now; None if it would wait."""
    record = intake.make_record("s", b"x" * (size - len(key)), key, None)
    if not intake.has_room(record, stream):
        return None
    intake.enqueue(stream, record)
    return record


def _ticking_intake(
    ticks: Iterator[int], max_records: int = 201, max_bytes: int = 10**9 + 3
) -> Intake:
    """An intake whose caps and reserves are not whole numbers (admission compares whole ones),
    its clock a millisecond further at each reading."""
    return Intake(
        max_records,
        max_bytes,
        _limits.DEFAULT_MAX_RECORD_SIZE,
        lambda: next(ticks) / 1000,
        lambda: None,
    )


def test_admitting_through_the_common_case_changes_what_the_general_path_changes() -> None:
    # Intake.admit_now takes the commonest records (a known key, a shard holding records, room
    # under every limit, an open aggregate that takes it) in one call of its own; everything
    # else goes through make_record, has_room and enqueue. Two intakes offered the same
    # records, one only through the general path, end in the same state: sealing by size and
    # by count, shard limits, the producer's reserve, the network path's bound, an idle
    # stream's send_now, and deadlines that come earlier than an open aggregate's (a shorter
    # max_buffered_time part of the time) with the Aggregator's wake-ups; every limit and
    # reserve a fraction; and the shards split mid-way (a new map).
    def run(fast: bool) -> dict[str, Any]:
        first_token = next(_wire._builder_tokens)
        ticks = iter(range(1, 10**6))
        sealed: list[KinesisRecord] = []
        wakes: list[int] = []
        sends: list[int] = []
        step = 0
        intake = _ticking_intake(ticks)
        stream = _stream(
            intake,
            shard_records=30.5,
            shard_bytes=20_000.5,
            max_count=9,
            ship=sealed.extend,
            wake=lambda: wakes.append(step),
        )
        stream.send_now = lambda: sends.append(step)
        rng = random.Random(3)
        keys = [f"key-{n}" for n in range(12)]
        admitted: list[Record | None] = []
        path_waits = []
        shorter = 0  # records admit_now admitted itself
        for step in range(3_000):
            if step == 1_500:  # the shards are split: the keys' remembered places are stale
                _publish(stream.shard_map, 6, 100)
            stream.max_buffered_time = 0.001 if step // 150 % 2 else 0.1
            # the network path's bound part of the time
            stream.path_bytes = 50_000.0 if step // 300 % 3 == 2 else math.inf
            stream.path_share = 8_000.0
            stream.idle = step % 37 == 0
            stream.wake_at = math.inf  # the Aggregator's task took the last wake-up
            key = rng.choice(keys)
            data = b"%05d" % step + b"x" * rng.randrange(0, 3_000)
            record = intake.admit_now(stream, "s", data, key, None) if fast else None
            shorter += record is not None
            if record is None:
                intake.since_checkpoint = 0  # the producer yields here
                record = intake.make_record("s", data, key, None)
                if intake.has_room(record, stream):
                    intake.enqueue(stream, record)
                else:
                    record = None
            admitted.append(record)
            path_waits.append(stream.path_waits)
            stream.path_waits = False
            if step % 25 == 24:  # some of what is outstanding ends
                intake.finish([r for r in admitted[-45:-15] if r is not None], True)
        aggregator = stream.aggregator
        return {
            "records": [
                None
                if r is None
                else (
                    r.data,
                    r.predicted_shard,
                    r.backlog and r.backlog.shard,
                    r.arrival,
                    r.deadline,
                    r.expiration,
                    r.size,
                    r.outstanding_slot,
                    r.done(),
                )
                for r in admitted
            ],
            "sealed": [(k.predicted_shard, k.data, k.deadline, k.expiration) for k in sealed],
            "open": sorted(
                (a.shard, a.builder.serialize(), a.deadline, a.expiration, len(a.records))
                for a in aggregator._open.values()
            ),
            "backlogs": sorted(
                (b.shard, b.outstanding_records, b.outstanding_bytes)
                for b in stream.backlogs.values()
            ),
            "intake": (len(intake.outstanding), intake.outstanding_bytes, intake.active_backlogs),
            "stream": (stream.outstanding_records, stream.outstanding_bytes, stream.received),
            "aggregator": (aggregator.buffered_records, aggregator.next_deadline),
            "keys": [
                (
                    f.index,
                    f.other_index,
                    f.table and f.table - first_token,
                    f.other_table and f.other_table - first_token,
                )
                for f in intake.key_cache.values()
            ],
            "path_waits": path_waits,
            "wakes": wakes,
            "sends": sends,
            "shorter": shorter,
        }

    general, fast = run(False), run(True)
    for part in general.keys() - {"shorter"}:
        assert fast[part] == general[part], part
    outcomes = general["records"]
    assert 0 < sum(o is None for o in outcomes) < len(outcomes)  # some records had to wait
    assert len(general["sealed"]) > 100  # sealed by size and by count
    assert any(general["path_waits"])  # some waited for the network path
    assert len(general["wakes"]) > 20  # deadlines brought forward
    assert len(general["sends"]) > 20  # an idle stream's first record asked for what is held


@pytest.mark.parametrize(
    ("max_records", "max_bytes"), [(201, 10**9 + 3), (10**6, 120_003)], ids=["records", "bytes"]
)
def test_admitting_batches_the_shorter_way_changes_what_the_general_path_changes(
    monkeypatch: pytest.MonkeyPatch, max_records: int, max_bytes: int
) -> None:
    # Intake.make_records and admit_ready (Producer.submit_many's common case) build and admit
    # the commonest records of a batch themselves, placed through the key cache; two intakes
    # offered the same batches, one building and admitting every record the general way
    # (make_record, has_room, enqueue_at with the batch's one clock reading, stopping at the
    # first record that must wait), end in the same state. Two streams share the key cache,
    # and the first one's shards are split mid-way (a new map: the keys' remembered places
    # are the old map's), then its map is found wrong (records wait unplaced) and replaced,
    # with limits, reserves and the path's bound as in the test above: tiny records part of
    # the time (a shard's record limit binds before its bytes), the producer's record cap or
    # its byte cap binding, a TTL shorter than max_buffered_time part of the time, idle streams.
    taken = [0]  # records the shorter way admitted (counted where the build lets a test look)
    if build_kind() != "compiled":
        shorter = Intake._admit_run

        def counted(
            self: Intake, stream: StreamIntake, records: list[Record], start: int, now: float
        ) -> int:
            end = shorter(self, stream, records, start, now)
            taken[0] += end - start
            return end

        monkeypatch.setattr(Intake, "_admit_run", counted)

    def run(fast: bool) -> dict[str, Any]:
        first_token = next(_wire._builder_tokens)
        ticks = iter(range(1, 10**6))
        sealed: list[KinesisRecord] = []
        sends: list[tuple[int, int]] = []
        wakes: list[tuple[int, int]] = []
        intake = _ticking_intake(ticks, max_records, max_bytes)
        streams = [
            _stream(
                intake,
                shard_records=30.5,
                shard_bytes=20_000.5,
                max_count=9,
                ship=sealed.extend,
                wake=lambda n=n: wakes.append((n, step)),  # type: ignore[misc]
            )
            for n in range(2)
        ]
        for n, stream in enumerate(streams):
            stream.send_now = lambda n=n: sends.append((n, step))  # type: ignore[misc]
            stream.path_share = 8_000.0
        rng = random.Random(5)
        keys = [f"key-{n}" for n in range(12)]
        admitted: list[Record | None] = []
        for step in range(400):
            if step == 200:
                _publish(streams[0].shard_map, 6, 100)
            elif step == 300:  # the map is found wrong: records wait unplaced until the next one
                assert streams[0].shard_map.invalidate(1.0, None)
            elif step == 330:
                _publish(streams[0].shard_map, 3, 200)
            stream = streams[rng.random() < 0.3]
            stream.path_bytes = 50_000.0 if step // 40 % 3 == 2 else math.inf
            stream.record_ttl = 0.05 if step // 25 % 2 else 30.0  # under max_buffered_time
            stream.idle = step % 7 == 0
            stream.wake_at = math.inf
            batch = BatchCounter()
            largest = 20 if step % 3 == 0 else 3_000
            items: list[Any] = [
                (b"%05d" % (step * 50 + i) + b"x" * rng.randrange(0, largest), rng.choice(keys))
                for i in range(rng.randrange(1, 40))
            ]
            if rng.random() < 0.1:  # an explicit hash key: the longer way
                items[0] = (*items[0], str(rng.randrange(2**128)))
            name = f"s{streams.index(stream)}"
            if fast:
                made = intake.make_records(name, items, batch)
                end = intake.admit_ready(stream, made, 0)
            else:
                made = []
                for data, key, *hash_key in items:
                    record = intake.make_record(name, data, key, hash_key[0] if hash_key else None)
                    record.batch = batch
                    made.append(record)
                batch.remaining = len(made)
                now = intake.clock()
                end = 0
                while end < len(made) and intake.has_room(made[end], stream):
                    intake.enqueue_at(stream, made[end], now)
                    end += 1
            admitted += made[:end] + [None] * (len(made) - end)
            if step % 2 == 1 and not 290 <= step < 330:  # some of what is outstanding ends
                done = [r for r in admitted[-300:-20] if r is not None]
                for s in streams:
                    s.finish([r for r in done if r.stream == f"s{streams.index(s)}"], True)
        return {
            "records": [
                None
                if r is None
                else (
                    r.stream,
                    r.data if r.key_facts is not None else len(r.data),
                    r.size,
                    r.predicted_shard,
                    r.backlog and r.backlog.shard,
                    r.arrival,
                    r.deadline,
                    r.expiration,
                    r.outstanding_slot,
                    r.done(),
                )
                for r in admitted
            ],
            # each shard's in order (the batch's records go to the aggregator by shard)
            "sealed": sorted(
                (
                    (k.records[0].stream, k.predicted_shard, len(k.records), k.deadline)
                    for k in sealed
                ),
                key=lambda k: (k[0], str(k[1])),
            ),
            "open": sorted(
                (a.shard, len(a.records), a.deadline)
                for s in streams
                for a in s.aggregator._open.values()
            ),
            "backlogs": [
                sorted(
                    (b.shard, b.outstanding_records, b.outstanding_bytes)
                    for b in s.backlogs.values()
                )
                for s in streams
            ],
            "intake": (len(intake.outstanding), intake.outstanding_bytes, intake.active_backlogs),
            "streams": [(s.outstanding_records, s.outstanding_bytes, s.received) for s in streams],
            "keys": [
                (f.index, f.other_index, f.table and f.table - first_token)
                for f in intake.key_cache.values()
            ],
            "sends": sends,
            "wakes": wakes,
            "path": [(s.path_waits, s.wake_at) for s in streams],
        }

    general, fast = run(False), run(True)
    for part in general:
        assert fast[part] == general[part], part
    outcomes = general["records"]
    admitted = sum(o is not None for o in outcomes)
    assert 3_000 < admitted < len(outcomes)  # some had to wait
    assert any(o[6] == o[7] for o in outcomes if o is not None)  # deadlines cut to the TTL
    assert len(general["sends"]) > 10  # an idle stream's first record asked for what is held
    assert {o[0] for o in outcomes if o is not None} == {"s0", "s1"}
    # both maps' shards took records: before the split and after it
    assert {o[3] for o in outcomes if o is not None and o[0] == "s0"} >= {
        "shardId-000000000000",
        "shardId-000000000105",
        None,  # admitted while the map was not ready
        "shardId-000000000202",
    }
    assert len(general["sealed"]) > 50
    assert len(general["wakes"]) > 10  # deadlines brought forward
    if build_kind() != "compiled":
        assert taken[0] > admitted * 0.8  # most went the shorter way


def test_finishing_counts_each_record_out_of_its_backlog_once() -> None:
    # Intake.finish counts a run of records of one backlog out at once: two shards' records
    # interleaved, some with a completion hook (SyncProducer's), each hook seeing the counts
    # with its own record out, and a backlog left empty inactive once.
    intake = _intake()
    stream = _stream(intake)
    keys = [_key_on(0), _key_on(1)]
    records = []
    for i in range(12):
        record = intake.make_record("s", b"x" * (10 + i), keys[i % 3 == 0], None)
        assert intake.has_room(record, stream)
        intake.enqueue(stream, record)
        records.append(record)
    assert intake.active_backlogs == 2
    backlogs = {id(r.backlog): r.backlog for r in records}
    seen: list[tuple[int, int]] = []
    hooked = records[::4] + records[-1:]
    for record in hooked:
        record.on_done = lambda r: seen.append(
            (r.backlog.outstanding_records, len(intake.outstanding))
        )
    # at a record's hook: its backlog holds the later records of its shard, the producer all
    # the later records
    expected = [
        (sum(1 for later in records[n + 1 :] if later.backlog is record.backlog), 11 - n)
        for n, record in enumerate(records)
        if record in hooked
    ]
    count, nbytes = intake.finish(records, True)
    assert (count, nbytes) == (12, sum(r.size for r in records))
    assert seen == expected
    assert [(b.outstanding_records, b.outstanding_bytes) for b in backlogs.values()] == [(0, 0)] * 2
    assert intake.active_backlogs == 0
    assert len(intake.outstanding) == 0
    assert intake.outstanding_bytes == 0
    assert all(r.done() for r in records)
    assert intake.finish(records, False) == (0, 0)  # once
    assert intake.active_backlogs == 0


class _Event:
    """What a task awaiting one record waits on (``Record._event``): counts its ``set``."""

    def __init__(self) -> None:
        self.sets = 0

    def set(self) -> None:
        self.sets += 1


@pytest.mark.parametrize("success", [True, False])
def test_finishing_counts_a_batchs_records_out_in_runs(success: bool) -> None:
    # Intake.finish takes a batch's count down once for each run of its records: two batches'
    # records interleaved, one record of each awaited by itself, one with a completion hook,
    # records of no batch among them. Each batch's hook runs once, when its last record ends,
    # with every record of it done; a record's hook sees its batch counted up to it.
    intake = _intake()
    stream = _stream(intake)
    batches = [BatchCounter(), BatchCounter()]
    order = [0, 0, 0, 1, 1, None, 0, 1, 1, 1, 0, None, 0]
    records = []
    for i, which in enumerate(order):
        record = intake.make_record("s", b"x" * (10 + i), _key_on(i % 2), None)
        if which is not None:
            record.batch = batches[which]
            batches[which].remaining += 1
        assert intake.has_room(record, stream)
        intake.enqueue(stream, record)
        records.append(record)
    events = {n: _Event() for n in (1, 8)}
    for n, event in events.items():
        records[n]._event = event  # type: ignore[assignment]
    seen: list[tuple[str, int, int]] = []

    def consistent() -> None:  # each batch's count is its records not yet done, at any hook
        for batch in batches:
            assert batch.remaining == sum(not r.done() for r in records if r.batch is batch)

    def record_done(record: Record) -> None:
        consistent()
        seen.append(("record", batches[0].remaining, batches[1].remaining))

    records[7].on_done = record_done

    def batch_done(which: int) -> None:
        batch = records[[n for n, w in enumerate(order) if w == which][-1]].batch
        assert batch is batches[which]
        consistent()
        seen.append(("batch", which, batch.failed))

    for which, batch in enumerate(batches):
        batch.on_done = lambda which=which: batch_done(which)  # type: ignore[misc]
    assert intake.finish(records, success) == (len(records), sum(r.size for r in records))
    assert all(r.done() for r in records)
    assert [e.sets for e in events.values()] == [1, 1]
    assert [(b.remaining, b.failed) for b in batches] == [
        (0, 0 if success else order.count(which)) for which in (0, 1)
    ]
    # at record 7's hook: batch 0 has its 4 records before it counted out (of 6), batch 1
    # its 3 (of 5) and record 7 itself
    assert seen == [
        ("record", 2, 2),
        ("batch", 1, 0 if success else 5),
        ("batch", 0, 0 if success else 6),
    ]
    assert intake.finish(records, not success) == (0, 0)  # once
    assert [b.remaining for b in batches] == [0, 0]


def test_a_record_the_common_case_builds_is_the_one_its_class_builds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Intake.admit_now builds its records slot by slot in the pure build (BUILD_BY_STORES,
    # cheaper than calling the class there): every slot is set, to what Record(...) sets,
    # and the record is untracked as the intake's other records are. The compiled build
    # calls the class.
    intake = _intake()
    stream = _stream(intake)
    key = _key_on(0)
    first = intake.make_record("s", b"x" * 10, key, None)
    assert intake.has_room(first, stream)
    intake.enqueue(stream, first)  # the shard holds a record: the next takes the common case
    if build_kind() != "compiled":  # the common case alone (a compiled class takes no patch)
        monkeypatch.setattr(Intake, "_admit_otherwise", lambda *args: None)
    record = intake.admit_now(stream, "s", b"y" * 20, key, None)
    assert record is not None
    twin = Record(
        "s",
        key,
        b"y" * 20,
        first.hash_key,
        None,
        record.arrival,
        record.deadline,
        record.expiration,
        first.size + 10,
        first.key_facts,
        first.backlog,
        first.outstanding_slot + 1,
    )
    slots = getattr(Record, "__slots__", None)
    if slots is None:  # a compiled class: no slots to name, and built by calling it
        assert not BUILD_BY_STORES
        slots = ("stream", "partition_key", "data", "size", "backlog", "outstanding_slot")
    else:
        assert build_kind() != "compiled"
        assert BUILD_BY_STORES
    for name in slots:
        assert getattr(record, name) == getattr(twin, name), name
    assert not record.done()
    assert gc.is_tracked(record) == gc.is_tracked(first)
    # and a batch's (Intake.make_records), built before it is admitted
    batch = BatchCounter()
    (made,) = intake.make_records("s", [(b"z" * 30, key)], batch)
    twin = Record("s", key, b"z" * 30, first.hash_key, None, 0.0, 0.0, 0.0, first.size + 20)
    twin.key_facts = first.key_facts
    twin.batch = batch
    for name in slots:
        assert getattr(made, name) == getattr(twin, name), name
    assert not made.done()
    assert gc.is_tracked(made) == gc.is_tracked(first)


def _shorter_way_alone(monkeypatch: pytest.MonkeyPatch, way: str) -> str:
    """The way a test of the shorter way takes: a submit's (Intake.admit_now) with the general
    way not taken where it declines, or a batch's (Intake._admit_run); a compiled class takes
    no patch, so there the batch's way only."""
    if way == "submit":
        if build_kind() == "compiled":
            return "submit_many"
        monkeypatch.setattr(Intake, "_admit_otherwise", lambda *args: None)
    return way


@pytest.mark.parametrize("way", ["submit", "submit_many"])
def test_the_shorter_way_holds_to_limits_and_reserves_that_are_not_whole_numbers(
    monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    # The shorter way (Intake.admit_now, a submit's, and Intake._admit_run, a batch's) compares
    # whole numbers (ShardBacklog.full_records/full_bytes, Intake.reserve_records/
    # reserve_bytes): at each limit's edge it decides as the general path's comparisons with
    # the fractional limits do, neither more nor less.
    way = _shorter_way_alone(monkeypatch, way)

    def shorter_way(intake: Intake, stream: StreamIntake, held: list[int], size: int) -> bool:
        key = _key_on(0)
        for held_size in held:  # what the shard holds first
            record = intake.make_record("s", b"x" * (held_size - len(key)), key, None)
            assert intake.has_room(record, stream)
            intake.enqueue(stream, record)
        data = b"y" * (size - len(key))
        if way == "submit":
            return intake.admit_now(stream, "s", data, key, None) is not None
        # the shorter way alone, a batch's (where it declines, nothing is admitted)
        record = intake.make_record("s", data, key, None)
        return intake._admit_run(stream, [record], 0, 0.0) == 1

    def stream_of(
        intake: Intake, records: float = math.inf, nbytes: float = math.inf
    ) -> StreamIntake:
        return _stream(intake, shard_records=records, shard_bytes=nbytes)

    intake = _intake()
    assert shorter_way(intake, stream_of(intake, records=2.5), [100, 100], 100)
    intake = _intake()
    assert not shorter_way(intake, stream_of(intake, records=2.5), [100, 100, 100], 100)
    intake = _intake()
    assert shorter_way(intake, stream_of(intake, nbytes=2_500.5), [1_000], 1_500)
    intake = _intake()
    assert not shorter_way(intake, stream_of(intake, nbytes=2_500.5), [1_000], 1_501)
    # the producer's reserve: 80 % of 11 records (8.8) and of 10,003 bytes (8,002.4)
    intake = _intake(max_records=11)
    assert shorter_way(intake, stream_of(intake), [100] * 8, 100)
    intake = _intake(max_records=11)
    assert not shorter_way(intake, stream_of(intake), [100] * 9, 100)
    intake = _intake(max_bytes=10_003)
    assert shorter_way(intake, stream_of(intake), [3_000, 3_000], 2_002)
    intake = _intake(max_bytes=10_003)
    assert not shorter_way(intake, stream_of(intake), [3_000, 3_000], 2_003)


@pytest.mark.parametrize("way", ["submit", "submit_many"])
def test_the_shorter_way_takes_a_record_for_a_shard_that_holds_nothing_while_the_caps_allow(
    monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    # A shard whose backlog is empty takes one record whatever its limits, unless the
    # producer's caps are reached (Intake.has_room): the shorter way decides the same, and
    # counts the shard active.
    way = _shorter_way_alone(monkeypatch, way)
    for cap, taken in ((3, False), (4, True)):
        intake = _intake(max_records=cap)
        stream = _stream(intake, shard_records=1.5)
        quiet = _offer(intake, stream, _key_on(1))
        assert quiet is not None
        intake.finish([quiet], True)  # shard 1 has a backlog, empty
        for _ in range(3):  # shard 0 holds three (enqueued whatever its limit)
            intake.enqueue(stream, intake.make_record("s", b"x" * 10, _key_on(0), None))
        assert len(intake.outstanding) == 3
        assert intake.active_backlogs == 1
        record = intake.make_record("s", b"y" * 10, _key_on(1), None)
        assert intake.has_room(record, stream) is taken  # the general path's answer
        record.backlog = None
        if way == "submit":
            admitted = intake.admit_now(stream, "s", record.data, _key_on(1), None) is not None
        else:
            admitted = intake._admit_run(stream, [record], 0, 0.0) == 1
        assert admitted is taken
        assert intake.active_backlogs == 1 + taken
        assert len(intake.outstanding) == 3 + taken


def test_a_hot_shards_backlog_never_makes_another_shards_record_wait() -> None:
    intake = _intake()
    stream = _stream(intake, shard_bytes=15_000)  # 15 records of 1,000 bytes per shard
    hot, cold = _key_on(0), _key_on(1)
    admitted = [_offer(intake, stream, hot) for _ in range(20)]
    assert sum(r is not None for r in admitted) == 15  # the hot shard is full: its callers wait
    assert _offer(intake, stream, hot) is None
    # the cold shard has its own room, whatever the hot one holds
    cold_records = [_offer(intake, stream, cold) for _ in range(15)]
    assert all(r is not None for r in cold_records)
    assert _offer(intake, stream, cold) is None
    # room comes back to the shard whose records finished, only
    intake.finish([r for r in admitted[:3] if r is not None], True)
    assert _offer(intake, stream, hot) is not None
    assert _offer(intake, stream, cold) is None


def test_a_shard_backlog_counts_its_records_out_when_they_finish() -> None:
    intake = _intake()
    stream = _stream(intake, shard_bytes=10_000)
    records = [_offer(intake, stream, _key_on(2)) for _ in range(5)]
    backlog = stream.backlogs["shardId-000000000002"]
    assert (backlog.outstanding_records, backlog.outstanding_bytes) == (5, 5000)
    assert intake.active_backlogs == 1
    intake.finish([r for r in records if r is not None], False)
    assert (backlog.outstanding_records, backlog.outstanding_bytes) == (0, 0)
    assert intake.active_backlogs == 0
    assert len(intake.outstanding) == 0


def test_the_oldest_outstanding_record_is_the_first_admitted_of_those_left() -> None:
    now = [10.0]
    intake = Intake(
        100_000, 128 * 1024 * 1024, _limits.DEFAULT_MAX_RECORD_SIZE, lambda: now[0], lambda: None
    )
    stream = _stream(intake, shard_bytes=1_000_000)
    assert intake.oldest_arrival() is None
    records: list[Record] = []
    for arrival, shard in ((10.0, 0), (11.0, 1), (12.0, 0)):
        now[0] = arrival
        record = _offer(intake, stream, _key_on(shard))
        assert record is not None
        records.append(record)
    assert intake.oldest_arrival() == 10.0
    intake.finish([records[1]], True)  # a younger one ends first: the oldest stays
    assert intake.oldest_arrival() == 10.0
    intake.finish([records[0]], False)
    assert intake.oldest_arrival() == 12.0
    intake.finish([records[2]], True)
    assert intake.oldest_arrival() is None


def _record(size: int = 100) -> Record:
    return Record("s", "k", b"x" * (size - 1), 1, None, 0.0, 0.0, 0.0, size)


def _end(outstanding: OutstandingRecords, records: list[Record]) -> None:
    """Resolve ``records`` and count them out, as Intake.finish does."""
    for record in records:
        outstanding.remove(record)
        record.resolve(True)
    outstanding.close_up()


def test_outstanding_records_give_the_pending_ones_oldest_first() -> None:
    outstanding = OutstandingRecords()
    assert not outstanding
    assert len(outstanding) == 0
    assert outstanding.oldest() is None
    records = [_record() for _ in range(5)]
    for record in records:
        outstanding.add(record)
    assert len(outstanding) == 5
    assert outstanding.oldest() is records[0]
    _end(outstanding, [records[0], records[3]])
    assert len(outstanding) == 3
    assert list(outstanding) == [records[1], records[2], records[4]]
    assert outstanding.oldest() is records[1]
    _end(outstanding, [records[1], records[2], records[4]])
    assert not outstanding
    assert list(outstanding) == []
    assert outstanding.oldest() is None
    outstanding.remove(records[1])  # ended already: nothing happens
    outstanding.remove(_record())  # never added: nothing happens
    assert len(outstanding) == 0


def test_outstanding_records_hold_no_ended_record_and_few_empty_slots() -> None:
    """An ended record's slot is emptied at once (the list keeps nothing that ended alive),
    and the empty slots are closed up once they outnumber the pending records by
    COMPACT_RECORDS: the list stays within twice what is pending and that many."""
    outstanding = OutstandingRecords()
    pending: list[Record] = []
    for _ in range(20):
        batch = [_record() for _ in range(500)]
        for record in batch:
            outstanding.add(record)
        pending.extend(batch)
        ended, pending = pending[:450], pending[450:]
        _end(outstanding, ended)
        assert len(outstanding) == len(pending)
        assert not any(r in ended for r in outstanding._records if r is not None)
        assert len(outstanding._records) <= 2 * len(pending) + COMPACT_RECORDS
        assert outstanding.oldest() is pending[0]
    assert list(outstanding) == pending
    base = outstanding._base
    assert base > 0  # the ended records' run before the oldest pending one was dropped
    assert [r.outstanding_slot - base for r in pending] == [
        outstanding._records.index(r) for r in pending
    ]


def test_records_ending_in_any_order_leave_the_outstanding_records_consistent() -> None:
    """Intake.finish counts records out of OutstandingRecords inline: through both ways of
    admission, records ending mostly in order (the run of ended slots before the oldest
    pending record is dropped at once) and out of order (empty slots among pending ones, the
    whole list closed up), every pending record stays at its slot, no ended one is kept, the
    list stays within its bound, and the oldest is the oldest."""
    rng = random.Random(7)
    intake = _intake(max_records=10**9, max_bytes=10**12)
    stream = _stream(intake)
    outstanding = intake.outstanding
    pending: list[Record] = []
    keys = [_key_on(shard, 1000 * shard) for shard in range(SHARDS)]
    for step in range(60):
        for n in range(rng.randrange(300, 900)):
            key = keys[n % SHARDS]
            record = intake.admit_now(stream, "s", b"x" * 20, key, None)
            if record is None:  # the general path (a checkpoint due, ...)
                record = _offer(intake, stream, key, 100)
                intake.since_checkpoint = 0
            assert record is not None
            pending.append(record)
        if step % 4 == 3:  # out of order: any of them
            ending = rng.sample(pending, len(pending) * 9 // 10)
        else:  # mostly in order: the oldest, and a few others
            ending = pending[: len(pending) // 2] + rng.sample(pending, 5)
        ended = {id(r) for r in ending}
        for start in range(0, len(ending), 37):  # a Kinesis record's worth at a time
            intake.finish(ending[start : start + 37], True)
        intake.finish(ending[:3], True)  # again: nothing happens
        pending = [r for r in pending if id(r) not in ended]
        assert all(r.done() and r.outstanding_slot == -1 for r in ending)
        assert len(outstanding) == len(pending)
        assert list(outstanding) == pending
        slots = outstanding._records
        assert all(slots[r.outstanding_slot - outstanding._base] is r for r in pending)
        assert sum(r is None for r in slots) == outstanding._empty
        assert len(slots) <= 2 * len(pending) + COMPACT_RECORDS
        assert outstanding.oldest() is (pending[0] if pending else None)
    assert outstanding._base > 0


def test_completion_hooks_see_exact_counts_and_may_admit_while_records_are_resolved() -> None:
    """Intake.finish runs records' completion hooks (the spool's ``on_recovered``, SyncProducer's
    futures) as it resolves them: each hook sees how many records are still pending and the
    oldest of them (none when the last ended), and may admit new records, which keep their
    places."""
    now = [1.0]
    intake = Intake(
        100_000, 128 * 1024 * 1024, _limits.DEFAULT_MAX_RECORD_SIZE, lambda: now[0], lambda: None
    )
    stream = _stream(intake)
    key = _key_on(0)
    seen: list[tuple[int, float | None]] = []
    admitted: list[Record] = []

    def hook(record: Record) -> None:
        seen.append((len(intake.outstanding), intake.oldest_arrival()))
        if len(admitted) < 2:
            new = _offer(intake, stream, key, 100)
            assert new is not None
            admitted.append(new)

    records = []
    for arrival in (1.0, 2.0, 3.0):
        now[0] = arrival
        record = _offer(intake, stream, key, 100)
        assert record is not None
        record.on_done = hook
        records.append(record)
    now[0] = 4.0
    # the youngest first (its hook admits one), then the two oldest (the first's hook admits
    # another)
    intake.finish([records[2]], True)
    intake.finish(records[:2], True)
    assert seen == [(2, 1.0), (2, 2.0), (2, 4.0)]
    assert len(intake.outstanding) == 2
    assert list(intake.outstanding) == admitted
    slots = intake.outstanding._records
    assert all(slots[r.outstanding_slot - intake.outstanding._base] is r for r in admitted)
    # the last pending records, which hold the last filled slots: the last hook sees none
    for record in admitted:
        record.on_done = hook
    intake.finish(admitted, True)
    assert seen[3:] == [(1, 4.0), (0, None)]
    assert len(intake.outstanding) == 0
    assert intake.oldest_arrival() is None


def test_a_completion_hook_that_resolves_records_itself_leaves_the_list_consistent() -> None:
    """A hook run while Intake.finish resolves records may resolve others itself, and that
    inner call may close the list up (drop its head, which moves every place's base): the
    outer call goes on with the list as it is then."""
    intake = _intake(max_records=10**6, max_bytes=10**12)
    stream = _stream(intake)
    key = _key_on(0)
    records = []
    for _ in range(5000):
        record = _offer(intake, stream, key, 100)
        assert record is not None
        records.append(record)
    outstanding = intake.outstanding

    bases = []

    def hook(record: Record) -> None:
        intake.finish(records[:3500], True)
        bases.append(outstanding._base)

    records[3500].on_done = hook
    intake.finish(records[3500:4900], True)
    assert bases == [3501]  # the inner call dropped the ended head, the hook's record with it
    assert outstanding._base == 4900  # and the outer one the rest
    assert all(r.done() for r in records[:4900])
    assert not any(r.done() for r in records[4900:])
    assert len(outstanding) == 100
    assert list(outstanding) == records[4900:]
    slots = outstanding._records
    assert sum(r is None for r in slots) == outstanding._empty
    assert all(slots[r.outstanding_slot - outstanding._base] is r for r in records[4900:])
    assert outstanding.oldest() is records[4900]


def test_given_partition_keys_are_remembered_and_random_ones_are_not() -> None:
    intake = _intake()
    first = intake.make_record("s", b"x", "device-1", None)
    again = intake.make_record("s", b"y", "device-1", None)
    assert first.key_facts is not None
    assert again.key_facts is first.key_facts
    assert first.hash_key == again.hash_key == hash_of("device-1")
    assert (first.size, again.size) == (9, 9)
    random = intake.make_record("s", b"x", None, None)
    assert random.key_facts is not None
    assert random.hash_key == hash_of(random.partition_key)
    assert list(intake.key_cache) == ["device-1"]
    # an explicit hash key places the record: no facts, nothing remembered
    placed = intake.make_record("s", b"x", "ключ", 42)
    assert placed.key_facts is None
    assert placed.hash_key == 42
    assert placed.size == 1 + len("ключ".encode())
    assert list(intake.key_cache) == ["device-1"]


def test_an_empty_shard_always_takes_one_record_of_any_size() -> None:
    intake = _intake()
    stream = _stream(intake, shard_bytes=100)
    assert _offer(intake, stream, _key_on(0)) is not None  # 1,000 bytes over a 100-byte limit
    assert _offer(intake, stream, _key_on(0)) is None
    assert _offer(intake, stream, _key_on(3)) is not None


def _fill(intake: Intake, stream: StreamIntake, key: str) -> int:
    """Admit records for ``key`` until one would wait; return how many were admitted."""
    admitted = 0
    while _offer(intake, stream, key) is not None:
        admitted += 1
    return admitted


def test_a_hot_shard_cannot_take_the_whole_producer_cap() -> None:
    # no backlog limit per shard: only the producer's cap of 100 records binds
    intake = _intake(max_records=100)
    stream = _stream(intake)
    # alone, the hot shard takes all but the reserve...
    assert _fill(intake, stream, _key_on(0)) == int(100 * (1 - RESERVE))
    # ...which quiet shards grow into, each while it holds less than an equal part of it (with
    # one shard more to come: 20 / 3)
    assert _fill(intake, stream, _key_on(1)) == 7
    assert _offer(intake, stream, _key_on(2)) is not None  # and some is left for a newcomer


def test_however_many_shards_are_hot_a_shard_that_holds_nothing_finds_room() -> None:
    # Two hot shards used to share the reserve between them (the second under its fair share
    # of the cap), and a third shard's first record waited for the producer's cap.
    for hot_shards in (1, 2, 3):
        intake = _intake(max_records=100)
        stream = _stream(intake)
        for shard in range(hot_shards):
            _fill(intake, stream, _key_on(shard))
        assert len(intake.outstanding) < 100
        assert _offer(intake, stream, _key_on(3)) is not None, hot_shards


def test_the_reserve_holds_for_bytes_too() -> None:
    intake = _intake(max_bytes=100_000)
    stream = _stream(intake)
    assert _offer(intake, stream, _key_on(1)) is not None
    # 80,000 bytes with the quiet shard's 1,000: the reserve begins
    assert _fill(intake, stream, _key_on(0)) == 79
    # the quiet shard grows into the reserve while it holds less than 20,000 / 3 bytes
    assert 1 + _fill(intake, stream, _key_on(1)) == 7
    assert _offer(intake, stream, _key_on(2)) is not None


def test_records_whose_shard_is_not_known_are_held_to_the_streams_limit() -> None:
    intake = _intake()
    stream = _stream(intake, shard_bytes=2000)
    stream.shard_map.fail_update()  # not READY: no shard can be predicted
    stream.backlog_records, stream.backlog_bytes = math.inf, 5000.0
    keys = [_key_on(0), _key_on(1), _key_on(2), _key_on(3), _key_on(0, 5000)]
    admitted = [_offer(intake, stream, key) for key in keys]
    assert all(r is not None for r in admitted)  # the stream's 5,000 bytes, any shard
    assert all(r.predicted_shard is None for r in admitted if r is not None)
    assert _offer(intake, stream, _key_on(1)) is None
    assert stream.unplaced.outstanding_records == 5


def test_once_the_map_is_ready_records_admitted_before_it_count_in_their_shards() -> None:
    intake = _intake()
    stream = _stream(intake, shard_bytes=2000)
    ranges = even_ranges(SHARDS)
    stream.shard_map.fail_update()  # not READY
    stream.backlog_records, stream.backlog_bytes = math.inf, 5000.0
    keys = [_key_on(0), _key_on(1), _key_on(2), _key_on(3), _key_on(0, 5000)]
    admitted = [_offer(intake, stream, key) for key in keys]
    assert all(r is not None for r in admitted)
    assert intake.active_backlogs == 1  # unplaced
    # the map comes: shard 0 already holds its 2,000 bytes, so its next record waits
    stream.shard_map.begin_update()
    stream.shard_map.apply_page(
        [
            {
                "ShardId": f"shardId-{i:012d}",
                "HashKeyRange": {"StartingHashKey": str(start), "EndingHashKey": str(end)},
            }
            for i, (start, end) in enumerate(ranges)
        ]
    )
    stream.shard_map.finish_update(1.0)
    intake.place_unplaced(stream)
    assert stream.unplaced.outstanding_records == 0
    assert stream.unplaced.outstanding_bytes == 0
    held = {shard: b.outstanding_bytes for shard, b in stream.backlogs.items()}
    assert held == {f"shardId-{i:012d}": (2000 if i == 0 else 1000) for i in range(SHARDS)}
    assert intake.active_backlogs == SHARDS
    assert _offer(intake, stream, _key_on(0, 9000)) is None
    assert _offer(intake, stream, _key_on(1, 9000)) is not None
    # they count out of the shards they moved to
    intake.finish(list(intake.outstanding), True)
    assert all(
        not b.outstanding_records and not b.outstanding_bytes for b in stream.backlogs.values()
    )
    assert intake.active_backlogs == 0


def test_the_stream_holds_what_the_path_has_proven_and_a_quiet_shard_its_part_of_it() -> None:
    intake = _intake()
    stream = _stream(intake)
    stream.path_bytes, stream.path_share = 8000.0, 2000.0  # 4 shards
    # a hot shard takes the whole of what the path has proven
    assert _fill(intake, stream, _key_on(0)) == 8
    assert stream.path_waits
    reason = intake.no_room_reason(
        intake.make_record("s", b"x" * 900, _key_on(0, 9000), None), stream
    )
    assert "network path to Kinesis has delivered (8000 bytes)" in reason, reason
    assert "shardId-000000000000 of stream 's' at least its part" in reason, reason
    # a shard holding less than its part of it (2,000) still takes records: the stream holds
    # less than twice what the path proved
    assert _fill(intake, stream, _key_on(1)) == 2
    assert _fill(intake, stream, _key_on(2)) == 2
    assert _offer(intake, stream, _key_on(1, 9000)) is None
    assert stream.outstanding_bytes == 12_000
    # the records whose shard is not known yet are held to it as well (past the first)
    stream.path_waits = False
    stream.shard_map.fail_update()
    assert _offer(intake, stream, _key_on(3)) is not None
    assert _offer(intake, stream, _key_on(3, 9000)) is None
    assert stream.path_waits
    reason = intake.no_room_reason(
        intake.make_record("s", b"x" * 900, _key_on(3, 9000), None), stream
    )
    assert "network path" in reason, reason


def test_a_record_that_waited_is_placed_again_when_it_is_checked() -> None:
    intake = _intake()
    stream = _stream(intake, shard_bytes=1000)
    key = _key_on(2)
    assert _offer(intake, stream, key) is not None
    waiting = intake.make_record("s", b"x" * 900, key, None)
    assert not intake.has_room(waiting, stream)
    assert waiting.predicted_shard == "shardId-000000000002"
    # the shard's records finish; the waiting record's next check admits it into its shard
    intake.finish(list(intake.outstanding), True)
    assert intake.has_room(waiting, stream)
    intake.enqueue(stream, waiting)
    assert waiting.backlog is stream.backlogs["shardId-000000000002"]


def test_no_room_reason_names_the_shard_or_the_caps() -> None:
    intake = _intake(max_records=100)
    stream = _stream(intake, shard_bytes=2000)
    key = _key_on(3)
    _offer(intake, stream, key)
    _offer(intake, stream, key)
    record = intake.make_record("s", b"x" * 900, key, None)
    reason = intake.no_room_reason(record, stream)
    assert "shard shardId-000000000003 of stream 's' holds 2 records / 2000 bytes" in reason
    assert "max_outstanding_time=15 s" in reason
    full = _intake(max_records=1)
    stream = _stream(full)
    _offer(full, stream, key)
    reason = full.no_room_reason(full.make_record("s", b"x", _key_on(1), None), stream)
    assert "1 records / " in reason
    assert "max_outstanding_records=1" in reason
