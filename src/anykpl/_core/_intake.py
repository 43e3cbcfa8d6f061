"""The intake: what :meth:`Producer.submit` does for each record once it may admit it.

Validation (:meth:`Intake.make_record`), the room check (:meth:`Intake.has_room`: the rule of
admission, per shard), admission (:meth:`Intake.enqueue`: the record's clock starts, it is
counted as outstanding and handed to its stream's :class:`~anykpl._core._aggregator.Aggregator`)
and, on the way back, resolving records (:meth:`Intake.finish`, a whole Kinesis record's user
records in one call). These are the
per-record steps of the producer; they are plain synchronous code on plain objects, kept apart
from the producer's lifecycle and its waits, so that the compiled build (mypyc, see
``pyproject.toml``) compiles them together with the stages they call into. The pure-Python
package runs the same code.

Two objects: one :class:`Intake` per producer (the producer-wide caps, the set of outstanding
records that is the producer's safety net, the partition key cache) and one
:class:`StreamIntake` per stream (its shards' backlogs and their limits, its counts, its
aggregator). The producer owns the first, each stream's pipeline the second; the stages never
touch them, apart from the Retrier's calls to :meth:`StreamIntake.finish`.

The rule (docs/admission.md). A record is admitted when it fits under the producer's caps
(``max_outstanding_records``/``max_outstanding_bytes``) and under its own predicted shard's
backlog limit: ``max_outstanding_time`` of what that shard delivers now (the pipeline plans it).
Records whose shard is not known yet (the shard map is loading, or invalid) are held to the
stream's limit instead, all of its shards together. Once the producer holds ``1 - RESERVE``
of a cap, the rest of it (the reserve) is for quiet shards: a shard grows into it only while it
holds less than an equal part of the reserve among the shards holding records and one more.
However many shards are hot, part of the reserve is left for a shard that holds nothing yet.
A hot shard's backlog thus makes only its own records wait.
"""

from __future__ import annotations

import math
import os
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from itertools import islice
from typing import Any, Final, Protocol

from .. import errors
from .._compat import gc_untracker
from . import _limits
from ._aggregator import Aggregator
from ._records import (
    BUILD_BY_STORES,
    FAILED,
    PENDING,
    SUCCEEDED,
    BatchCounter,
    ColumnBatch,
    KinesisRecord,
    Record,
    ShardBacklog,
    at_least,
    at_most,
    new_record,
    partition_key_hash,
    untrack_record,
)
from ._shard_map import ShardMap
from ._wire import AGGREGATION_OVERHEAD, KeyFacts, key_table_entry, untrack_list

__all__ = (
    "CHECKPOINT_EVERY",
    "COMPACT_RECORDS",
    "KEY_CACHE_LIMIT",
    "RESERVE",
    "Intake",
    "OutstandingRecords",
    "SpoolStore",
    "StreamIntake",
    "offset_clock",
)

#: Partition keys whose hash key and UTF-8 length are remembered (cleared when full).
KEY_CACHE_LIMIT: Final = 65536

#: A loop of submits that never has to wait yields to the event loop every this many admissions
#: (letting the stages run and cancellation in): a checkpoint per call would cost more than the
#: rest of the admission. Each checkpoint wakes the stages, whose runtime is interpreted in
#: both builds: from 128 to 256, the pure build's idiomatic loop of 100,000 records to the
#: emulator took 1.71 → 1.66 s (asyncio) and 1.88 → 1.80 s (trio), the compiled build's the
#: same within noise; a loop of 256 admissions holds the event loop 1-2 ms compiled, 4 ms
#: pure. The same count as ``_records.RESOLVED_YIELD_EVERY`` for a loop of awaits.
CHECKPOINT_EVERY: Final = 256

#: The share of each producer cap kept for quiet shards: once the producer holds the rest of a
#: cap, only shards holding less than an equal part of the reserve (with one more shard to
#: come) are admitted, so a shard that holds nothing yet always finds room.
RESERVE: Final = 0.2

#: :class:`OutstandingRecords` closes up the slots of ended records once they are more than
#: this many besides as many as are pending.
COMPACT_RECORDS: Final = 1024


class OutstandingRecords:
    """Every admitted record until it is terminal, in order of admission: the producer's
    safety net (whatever happens to a stage, what is left here can be failed, so no awaiter
    ever hangs). Iterating gives the records still pending, oldest first; ``len`` is how many
    there are, a column batch's items included (``Intake.admit_columns``: they are counted,
    with no record and no slot, until a record is made of one and :meth:`adopt` gives it one).

    A list: a record is appended when admitted (``Record.outstanding_slot`` is its place,
    counted from the first record the list ever held: slot ``outstanding_slot - _base``) and
    its slot emptied when it ends, so the list holds no ended record. Once the empty slots
    outnumber the pending records by :data:`COMPACT_RECORDS` they are closed up: first the
    run of them before the oldest pending record, dropped at once (records mostly end in the
    order they came), which moves ``_base`` and no record's place; then, if as many empty
    slots are still left among the pending records, the whole list in one pass. Each record
    thus costs an append, a store and a share of a copy, where a dictionary, taken in order of
    admission and emptied from its oldest end, cost 0.3 us or more per record once it held
    tens of thousands (a large, sparse table).
    """

    __slots__ = ("_base", "_empty", "_head", "_records", "count")

    def __init__(self) -> None:
        self._records: list[Record | None] = []
        # the place (``Record.outstanding_slot``) of ``_records[0]``
        self._base = 0
        # pending records (the filled slots)
        self.count = 0
        # empty slots in ``_records``
        self._empty = 0
        # no pending record before this slot
        self._head = 0

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Record]:
        """The pending records, oldest first (a snapshot: they may end meanwhile)."""
        return iter([record for record in self._records if record is not None])

    def add(self, record: Record) -> None:
        """``record`` was admitted (:meth:`Intake.enqueue_at` does the same inline)."""
        records = self._records
        record.outstanding_slot = self._base + len(records)
        records.append(record)
        self.count += 1

    def adopt(self, record: Record) -> None:
        """``record``, counted already (a column batch's item: ``count`` holds those without a
        slot), takes a slot: the per-record path has taken it over."""
        records = self._records
        record.outstanding_slot = self._base + len(records)
        records.append(record)

    def remove(self, record: Record) -> None:
        """``record`` ended (once; a record never added is ignored). :meth:`Intake.finish`
        does the same inline."""
        slot = record.outstanding_slot - self._base
        records = self._records
        if 0 <= slot < len(records) and records[slot] is record:
            records[slot] = None
            record.outstanding_slot = -1
            self.count -= 1
            self._empty += 1

    def close_up(self) -> None:
        """Close up the empty slots if they are many (after records ended)."""
        if self._empty <= self.count + COMPACT_RECORDS:
            return
        records = self._records
        first = self._first_filled()
        if first:
            del records[:first]
            self._base += first
            self._empty -= first
            self._head = 0
        if self._empty > self.count + COMPACT_RECORDS:
            kept: list[Record | None] = []
            base = self._base
            for record in records:
                if record is not None:
                    record.outstanding_slot = base + len(kept)
                    kept.append(record)
            self._records = kept
            self._empty = 0
            self._head = 0

    def _first_filled(self) -> int:
        """The first filled slot (``len(_records)`` if none), looked for from ``_head``."""
        records = self._records
        # by builtins, no bytecode per slot: an empty slot is None, a record is true
        first = next(filter(None, islice(records, self._head, None)), None)
        return len(records) if first is None else first.outstanding_slot - self._base

    def oldest(self) -> Record | None:
        """The pending record admitted first, ``None`` when none is."""
        if not self.count:
            return None
        records = self._records
        slot = self._head = self._first_filled()
        return records[slot] if slot < len(records) else None


class SpoolStore(Protocol):
    """What the intake asks of the durable spool's store (``_runtime/_spool.py``, which
    writes the files): room, an append when a record is admitted and a word when it is
    terminal."""

    @property
    def bytes(self) -> int: ...
    @property
    def max_bytes(self) -> int: ...
    @property
    def segments(self) -> Sized: ...
    def has_room(self, size: int) -> bool: ...
    def append(self, record: Record) -> None: ...
    def finished(self, segment: Any, success: bool) -> None: ...


class Intake:
    """The producer-wide part of admission: caps, outstanding records, the key cache."""

    def __init__(
        self,
        max_records: int,
        max_bytes: int,
        max_record_size: int,
        clock: Callable[[], float],
        on_finish: Callable[[], None],
    ) -> None:
        self.max_records = max_records
        self.max_bytes = max_bytes
        # past these in all, only quiet shards grow into the rest of the caps (RESERVE; at
        # least one record of it)
        self.reserved_records = max(1.0, max_records * RESERVE)
        self.reserved_bytes = max_bytes * RESERVE
        # the caps less the reserve, as whole numbers (admission compares counts with them, see
        # ``at_least``)
        self.reserve_records = at_least(max_records - self.reserved_records)
        self.reserve_bytes = at_most(max_bytes - self.reserved_bytes)
        # shard backlogs (of every stream) that hold records
        self.active_backlogs = 0
        self.max_record_size = max_record_size
        self.clock = clock
        self.clock_base = clock
        self.clock_offset = 0.0
        # called after records were resolved (the producer wakes submits waiting for room)
        self.on_finish = on_finish
        # every admitted record until it is terminal: the producer's safety net
        self.outstanding = OutstandingRecords()
        # the column batches admitted (admit_columns), pruned of finished ones now and then
        self.column_batches: list[ColumnBatch] = []
        self.column_batches_pruned_at = 64
        # the bytes (data and keys) of the batches in that list, and the most it may hold
        # before it is pruned: a finished batch holds its payload, which the caps no longer
        # count
        self.column_bytes = 0
        self.column_bytes_pruned_at = max_bytes
        self.outstanding_bytes = 0
        # partition key -> its KeyFacts (hash key, UTF-8 length, key table entry, the
        # aggregates that hold it): IoT-style workloads reuse keys, and an MD5 costs more
        # than the dictionary lookup
        self.key_cache: dict[str, KeyFacts] = {}
        # the durable spool (``spool_dir``): every admitted record is appended to it
        self.spool: SpoolStore | None = None
        # while records recovered from the spool are admitted, new records wait (they go first)
        self.recovering = False
        # records failed by the producer's own end (close, a crashed stage) stay spooled, for
        # the next producer on the directory
        self.keep_spooled = False
        # admissions since the producer's submits last yielded to the event loop
        self.since_checkpoint = 0

    def use_clock(
        self,
        clock: Callable[[], float],
        base: Callable[[], float] | None = None,
        offset: float = 0.0,
    ) -> None:
        """Read the time with ``clock`` from now on; where given, ``base() + offset`` is the
        same time (trio's default clock is ``perf_counter() + offset``), and admission reads
        it that way: a builtin's call and an addition, where ``clock`` is a function of ours
        (300 instructions a record in the compiled build, callgrind)."""
        self.clock = clock
        if base is None:
            self.clock_base = clock
            self.clock_offset = 0.0
        else:
            self.clock_base = base
            self.clock_offset = offset

    def admit_now(
        self,
        stream_intake: StreamIntake,
        stream: object,
        data: object,
        partition_key: object,
        explicit_hash_key: object,
    ) -> Record | None:
        """:meth:`Producer.submit`'s common case in one call: validate the record and, if it
        may be admitted without waiting (room now, no checkpoint due, the stream's shard map
        ready), admit it and return it. ``None``: the caller takes the general path (nothing
        was admitted).

        The commonest record (bytes under a partition key, no spool, the shard map ready; a
        shard that holds records already and has room under every limit with the producer's
        reserve untouched, or one that holds none while the producer's caps allow) takes the
        steps of :meth:`make_record`, :meth:`has_room` and
        :meth:`enqueue_at` here, inline: in the pure build a call costs as much as a tenth of
        the rest. A key new to the key cache is learnt on the way (:meth:`learn_key`). Any
        other record takes those methods (:meth:`_admit_otherwise`). A batch's records take
        the same way in runs (:meth:`_admit_run`).

        :raises: as :meth:`make_record` and :meth:`enqueue`.
        """
        since = self.since_checkpoint + 1
        if (
            type(partition_key) is str
            and explicit_hash_key is None
            and type(data) is bytes
            and type(stream) is str
            and since < CHECKPOINT_EVERY
            and self.spool is None
        ):
            facts = self.key_cache.get(partition_key)
            if facts is None:
                facts = self.learn_key(partition_key)
        else:
            facts = None
        if facts is None:
            return self._admit_otherwise(
                stream_intake, stream, data, partition_key, explicit_hash_key
            )
        size = len(data) + facts.size  # type: ignore[arg-type]  # bytes (checked above)
        shard_map = stream_intake.shard_map
        if size > self.max_record_size or not shard_map.ready:
            return self._admit_otherwise(
                stream_intake, stream, data, partition_key, explicit_hash_key
            )
        backlog = facts.backlog
        if facts.placed != shard_map.version or backlog is None:
            backlog = self._place_key(stream_intake, facts)
            if backlog is None:
                return self._admit_otherwise(
                    stream_intake, stream, data, partition_key, explicit_hash_key
                )
        held = backlog.outstanding_records
        held_bytes = backlog.outstanding_bytes
        outstanding = self.outstanding
        nbytes = self.outstanding_bytes + size
        if not held:
            # a shard that holds nothing takes a record while the producer's caps allow
            # (has_room's answer), and is active from now on
            count = outstanding.count
            if count and (count >= self.max_records or nbytes > self.max_bytes):
                return self._admit_otherwise(
                    stream_intake, stream, data, partition_key, explicit_hash_key
                )
            self.active_backlogs += 1
        elif (
            outstanding.count >= self.reserve_records
            or nbytes > self.reserve_bytes
            or held >= backlog.full_records
            or held_bytes + size > backlog.full_bytes
            or (
                stream_intake.outstanding_bytes + size > stream_intake.path_bytes
                and held_bytes >= stream_intake.path_share
            )
        ):
            return self._admit_otherwise(
                stream_intake, stream, data, partition_key, explicit_hash_key
            )
        now = self.clock_base() + self.clock_offset  # self.clock(), see use_clock
        deadline = now + stream_intake.max_buffered_time
        expiration = now + stream_intake.record_ttl
        if deadline > expiration:
            deadline = expiration
        slots = outstanding._records
        slot = outstanding._base + len(slots)
        if BUILD_BY_STORES:
            # Record(...) below, slot by slot (tests/test_intake.py checks that the two agree)
            record = new_record(Record)
            record.stream = stream  # type: ignore[assignment]  # str (checked above)
            record.partition_key = facts.key
            record.data = data  # type: ignore[assignment]  # bytes (checked above)
            record.hash_key = facts.hash_key
            record.explicit_hash_key = None
            record.size = size
            record.key_facts = facts
            record.shard_id = None
            record.sequence_number = None
            record.sub_sequence_number = None
            record.tenant = None
            record.spool_segment = None
            record.last_attempt = None
            record._earlier_attempts = ()
            record._state = PENDING
            record._event = None
            record.on_done = None
            record.batch = None
            if untrack_record is not None:  # see Record
                untrack_record(id(record))
            record.arrival = now
            record.deadline = deadline
            record.expiration = expiration
            record.predicted_shard = backlog.shard
            record.backlog = backlog
            record.outstanding_slot = slot
        else:
            record = Record(
                stream,  # type: ignore[arg-type]  # str (checked above)
                facts.key,
                data,  # type: ignore[arg-type]  # bytes (checked above)
                facts.hash_key,
                None,
                now,
                deadline,
                expiration,
                size,
                facts,
                backlog,
                slot,
            )
        slots.append(record)
        outstanding.count += 1
        self.outstanding_bytes = nbytes
        backlog.outstanding_records = held + 1
        backlog.outstanding_bytes = held_bytes + size
        stream_intake.outstanding_records += 1
        stream_intake.outstanding_bytes += size
        stream_intake.received += 1
        if not stream_intake.aggregator.add_to_open(record, facts):
            stream_intake.put(record)
        elif stream_intake.idle:
            stream_intake.idle = False
            stream_intake.send_now()
        self.since_checkpoint = since
        return record

    def _admit_otherwise(
        self,
        stream_intake: StreamIntake,
        stream: object,
        data: object,
        partition_key: object,
        explicit_hash_key: object,
    ) -> Record | None:
        """:meth:`admit_now` for a record its common case does not take: build and check it
        (:meth:`make_record`), and admit it if it may be without waiting; ``None`` where the
        caller takes the general path."""
        since = self.since_checkpoint + 1
        record = self.make_record(stream, data, partition_key, explicit_hash_key)
        # checkpoint_due and enqueue, inline (two calls less per record)
        if (
            since >= CHECKPOINT_EVERY
            or not stream_intake.shard_map.ready
            or not self.has_room(record, stream_intake)
        ):
            return None
        self.since_checkpoint = since
        self.enqueue_at(stream_intake, record, self.clock_base() + self.clock_offset)
        return record

    def _place_key(self, stream_intake: StreamIntake, facts: KeyFacts) -> ShardBacklog | None:
        """The backlog of the shard that ``facts``' hash key falls in under ``stream_intake``'s
        shard map (ready), remembered in ``facts`` for that map (see :class:`KeyFacts`);
        ``None`` where the shard has no backlog yet (the longer way makes it)."""
        shard_map = stream_intake.shard_map
        ends = shard_map._ends
        slot = bisect_left(ends, facts.hash_key)
        if slot >= len(ends):
            return None
        backlog = stream_intake.backlogs.get(shard_map._ids[slot])
        if backlog is not None:
            facts.placed = shard_map.version
            facts.backlog = backlog
        return backlog

    def make_records(
        self, stream: object, items: Iterable[object], batch: BatchCounter
    ) -> list[Record]:
        """Validate a batch (:meth:`Producer.submit_many`'s items) and build its handles, not
        yet admitted, each counted in ``batch``. Each item is the record's data, or a tuple
        ``(data, partition_key)`` or ``(data, partition_key, explicit_hash_key)``.

        :raises: as :meth:`make_record`, the message naming the item (``records[3]: ...``).
        """
        made: list[Record] = []
        append = made.append
        key_cache = self.key_cache
        max_record_size = self.max_record_size
        name = stream if type(stream) is str else None
        for item in items:
            # the commonest item first, inline: ``(bytes, str)`` of a valid size under a
            # partition key the key cache knows (so valid) or learns, for a stream named by a
            # str
            if name is not None and type(item) is tuple and len(item) == 2:
                data, partition_key = item
                if type(data) is bytes and type(partition_key) is str:
                    facts = key_cache.get(partition_key)
                    if facts is None:
                        try:
                            facts = self.learn_key(partition_key)
                        except errors.InvalidRecordError as exc:
                            raise type(exc)(f"records[{len(made)}]: {exc}") from None
                    size = len(data) + facts.size
                    if size <= max_record_size:
                        if BUILD_BY_STORES:
                            # Record(...) below, slot by slot, as in admit_now (the slots
                            # admission sets are set then: _admit_run, enqueue_at)
                            record = new_record(Record)
                            record.stream = name
                            record.partition_key = facts.key
                            record.data = data
                            record.hash_key = facts.hash_key
                            record.explicit_hash_key = None
                            record.size = size
                            record.key_facts = facts
                            record.shard_id = None
                            record.sequence_number = None
                            record.sub_sequence_number = None
                            record.tenant = None
                            record.spool_segment = None
                            record.last_attempt = None
                            record._earlier_attempts = ()
                            record._state = PENDING
                            record._event = None
                            record.on_done = None
                            record.arrival = 0.0
                            record.deadline = 0.0
                            record.expiration = 0.0
                            record.predicted_shard = None
                            record.backlog = None
                            record.outstanding_slot = -1
                        else:
                            record = Record(
                                name,
                                facts.key,
                                data,
                                facts.hash_key,
                                None,
                                0.0,
                                0.0,
                                0.0,
                                size,
                                facts,
                            )
                        if untrack_record is not None:  # the pure package (see Record)
                            untrack_record(id(record))
                        record.batch = batch
                        append(record)
                        continue
            try:
                data, partition_key, explicit_hash_key = _unpack_batch_record(item)
                record = self.make_record(stream, data, partition_key, explicit_hash_key)
            except (errors.RecordTypeError, errors.InvalidRecordError) as exc:
                raise type(exc)(f"records[{len(made)}]: {exc}") from None
            record.batch = batch
            append(record)
        batch.remaining = len(made)
        return made

    def admit_ready(self, stream_intake: StreamIntake, records: list[Record], start: int) -> int:
        """Admit ``records[start:]`` in order for as long as each fits now (no wait, no
        checkpoint: :meth:`Producer.submit_many`'s common case, one call for the batch), and
        return the position of the first record not admitted (``len(records)``: all were).

        The records that take the shorter way (:meth:`admit_now`'s) are admitted in runs
        (:meth:`_admit_run`); each other record by :meth:`has_room` and :meth:`enqueue_at`.

        :raises ~anykpl.errors.SpoolError: as :meth:`enqueue`, with ``admitted`` set to the
            handles of the records admitted before it (those of ``records[:position]``).
        """
        position = start
        end = len(records)
        now = self.clock()  # admitted together: one arrival time for the batch
        shorter = self.spool is None  # the shorter way may be taken
        while position < end:
            if shorter and stream_intake.shard_map.ready:
                position = self._admit_run(stream_intake, records, position, now)
                if position == end:
                    break
            record = records[position]
            if not self.has_room(record, stream_intake):
                break
            try:
                self.enqueue_at(stream_intake, record, now)
            except errors.SpoolError as exc:
                exc.admitted = tuple(records[:position])
                raise
            position += 1
        return position

    def _admit_run(
        self, stream_intake: StreamIntake, records: list[Record], start: int, now: float
    ) -> int:
        """Admit ``records[start:]`` at ``now`` in order for as long as each takes
        :meth:`admit_now`'s shorter way (under the key cache's facts, no tenant, the stream's
        shard map ready, no spool; a shard that holds records already and has room under every
        limit with the producer's reserve untouched, or one that holds none while the producer's
        caps allow), and return the position of the first
        that does not (``len(records)``: all did). What :meth:`admit_now` does for one record,
        with what is the same for every record of the run read once: the counts are kept in
        locals and written back at the end, and the records go to the aggregator by shard
        (:meth:`StreamIntake.put_runs`), in order within each shard."""
        position = start
        version = stream_intake.shard_map.version
        deadline = now + stream_intake.max_buffered_time
        expiration = now + stream_intake.record_ttl
        if deadline > expiration:
            deadline = expiration
        outstanding = self.outstanding
        slots = outstanding._records
        slot = outstanding._base + len(slots)
        append = slots.append
        count = outstanding.count
        nbytes = self.outstanding_bytes
        max_records = self.max_records
        max_bytes = self.max_bytes
        reserve_records = self.reserve_records
        reserve_bytes = self.reserve_bytes
        stream_bytes = stream_intake.outstanding_bytes
        # as whole numbers, compared with whole numbers (see at_least): the same answers
        path_bytes = at_most(stream_intake.path_bytes)
        path_share = at_least(stream_intake.path_share)
        runs: dict[ShardBacklog, list[Record]] = {}
        try:
            for position in range(start, len(records)):
                record = records[position]
                facts = record.key_facts
                if facts is None or record.tenant is not None:
                    break
                size = record.size
                backlog = facts.backlog
                if facts.placed != version or backlog is None:
                    backlog = self._place_key(stream_intake, facts)
                    if backlog is None:
                        break
                held = backlog.outstanding_records
                held_bytes = backlog.outstanding_bytes
                if not held:
                    # a shard that holds nothing takes a record while the producer's caps
                    # allow (has_room's answer), and is active from now on
                    if count and (count >= max_records or nbytes + size > max_bytes):
                        break
                    self.active_backlogs += 1
                elif (
                    count >= reserve_records
                    or nbytes + size > reserve_bytes
                    or held >= backlog.full_records
                    or held_bytes + size > backlog.full_bytes
                    or (stream_bytes + size > path_bytes and held_bytes >= path_share)
                ):
                    break
                record.arrival = now
                record.deadline = deadline
                record.expiration = expiration
                record.predicted_shard = backlog.shard
                record.backlog = backlog
                record.outstanding_slot = slot
                slot += 1
                append(record)
                count += 1
                nbytes += size
                stream_bytes += size
                backlog.outstanding_records = held + 1
                backlog.outstanding_bytes = held_bytes + size
                run = runs.get(backlog)
                if run is None:
                    runs[backlog] = [record]
                else:
                    run.append(record)
            else:
                position = len(records)
        finally:
            admitted = position - start
            if admitted:
                outstanding.count = count
                self.outstanding_bytes = nbytes
                stream_intake.outstanding_records += admitted
                stream_intake.outstanding_bytes = stream_bytes
                stream_intake.received += admitted
                stream_intake.put_runs(runs)
        return position

    def valid_pairs(self, items: Sequence[object]) -> bool:
        """Whether every item is a ``(bytes, str)`` pair that :meth:`make_records` would take:
        a valid partition key (learnt into the key cache) and a size within
        ``max_user_record_size``. Checks only (for a stream's first batch, before it waits for
        the map: bad input still raises at once, from the per-record way)."""
        key_cache = self.key_cache
        for item in items:
            if type(item) is not tuple or len(item) != 2:
                return False
            data, partition_key = item
            if type(data) is not bytes or type(partition_key) is not str:
                return False
            facts = key_cache.get(partition_key)
            if facts is None:
                try:
                    facts = self.learn_key(partition_key)
                except errors.InvalidRecordError:
                    return False
            if len(data) + facts.size > self.max_record_size:
                return False
        return True

    def takes_columns(self, stream_intake: StreamIntake) -> bool:
        """Whether a batch of ``(bytes, str)`` pairs for this stream may go in columns (once
        its shard map is ready, and room permitting: :meth:`admit_columns`): no spool, and
        aggregation on without ``container_key_from_records``."""
        aggregator = stream_intake.aggregator
        return (
            self.spool is None
            and stream_intake.takes_columns
            and aggregator.enabled
            and not aggregator.container_key_from_records
        )

    def admit_columns(
        self, stream_intake: StreamIntake, stream: str, items: Sequence[object]
    ) -> ColumnBatch | None:
        """Admit a ``submit_many`` batch's common case without a :class:`Record` per item:
        every item a ``(bytes, str)`` pair, the stream's shard map ready, no spool, and room
        for the whole batch now. Validates every item into columns (data, key facts, size),
        places each in its shard's backlog and checks it as :meth:`_admit_run` checks a record;
        then counts them all in and hands them to the aggregator in runs by shard
        (:meth:`StreamIntake.put_columns`). All or nothing: ``None`` leaves no trace, and the
        caller takes the batch the per-record way (which also raises for bad input)."""
        if (
            not stream_intake.shard_map.ready
            or not self.takes_columns(stream_intake)
            or self.outstanding.count + len(items) > self.max_records  # (never fits whole)
        ):
            return None
        aggregator = stream_intake.aggregator
        key_cache = self.key_cache
        # an item that could not share an aggregate goes raw: the per-record path takes the
        # batch (64 bytes: more than an item's framing in an aggregate)
        max_record_size = min(
            self.max_record_size, aggregator.items_limit() - AGGREGATION_OVERHEAD - 64
        )
        datas: list[bytes] = []
        facts_col: list[KeyFacts] = []
        sizes: list[int] = []
        dapp = datas.append
        fapp = facts_col.append
        sapp = sizes.append
        version = stream_intake.shard_map.version
        # the batch's positions by the shard backlog their key places them in
        runs: dict[ShardBacklog, list[int]] = {}
        position = 0
        for item in items:
            if type(item) is not tuple or len(item) != 2:
                return None
            data, partition_key = item
            if type(data) is not bytes or type(partition_key) is not str:
                return None
            facts = key_cache.get(partition_key)
            if facts is None:
                try:
                    facts = self.learn_key(partition_key)
                except errors.InvalidRecordError:
                    return None
            size = len(data) + facts.size
            if size > max_record_size:
                return None
            backlog = facts.backlog
            if facts.placed != version or backlog is None:
                backlog = self._place_column_key(stream_intake, facts, version)
                if backlog is None:
                    return None
            run = runs.get(backlog)
            if run is None:
                runs[backlog] = [position]
            else:
                run.append(position)
            position += 1
            dapp(data)
            fapp(facts)
            sapp(size)
        n = position
        if not n:
            return None
        total = sum(sizes)
        count = self.outstanding.count + n
        nbytes = self.outstanding_bytes + total
        # each backlog's records and bytes with the batch's items in it
        held_by: dict[ShardBacklog, tuple[int, int]] = {}
        # Every item fits if the totals with all of them in do (each check compares what is
        # held before an item, plus its size, which the totals bound); otherwise each is
        # checked in order, as _admit_run would (all or nothing: None leaves no trace)
        fits = (
            count - 1 < at_least(self.reserve_records)
            and nbytes <= at_most(self.reserve_bytes)
            and stream_intake.outstanding_bytes + total <= at_most(stream_intake.path_bytes)
        )
        if fits:
            take = sizes.__getitem__
            for backlog, run in runs.items():
                held = backlog.outstanding_records + len(run)
                held_bytes = backlog.outstanding_bytes + sum(map(take, run))
                if held - 1 >= backlog.full_records or held_bytes > backlog.full_bytes:
                    fits = False
                    break
                held_by[backlog] = (held, held_bytes)
        if not fits and not self._columns_fit(stream_intake, facts_col, sizes, held_by):
            return None
        # admitted, all of them
        if untrack_list is not None:  # (columns of bytes, KeyFacts and numbers; positions)
            untrack_list(id(datas))
            untrack_list(id(facts_col))
            untrack_list(id(sizes))
            for run in runs.values():
                untrack_list(id(run))
        for backlog, (records, held_bytes) in held_by.items():
            if not backlog.outstanding_records:
                self.active_backlogs += 1
            backlog.outstanding_records = records
            backlog.outstanding_bytes = held_bytes
        self.outstanding.count = count
        self.outstanding_bytes = nbytes
        stream_intake.outstanding_records += n
        stream_intake.outstanding_bytes += total
        stream_intake.received += n
        now = self.clock()
        deadline = now + stream_intake.max_buffered_time
        expiration = now + stream_intake.record_ttl
        if deadline > expiration:
            deadline = expiration
        counter = BatchCounter()
        counter.remaining = n
        columns = ColumnBatch(stream, datas, facts_col, sizes, counter, now, deadline, expiration)
        columns.adopt = self.outstanding.adopt
        columns.runs = runs
        columns.nbytes = total
        self.column_batches.append(columns)
        self.column_bytes += total
        if (
            len(self.column_batches) >= self.column_batches_pruned_at
            or self.column_bytes > self.column_bytes_pruned_at
        ):
            self._prune_column_batches()
            self.column_batches_pruned_at = max(64, 2 * len(self.column_batches))
            self.column_bytes_pruned_at = max(self.max_bytes, 2 * self.column_bytes)
        stream_intake.put_columns(columns)
        return columns

    def _place_column_key(
        self, stream_intake: StreamIntake, facts: KeyFacts, version: int
    ) -> ShardBacklog | None:
        """The backlog of the shard ``facts``' key falls in (remembered in ``facts``), made if
        the shard is new to the stream, as :meth:`StreamIntake.place` makes it; ``None`` if the
        map has no shard for it."""
        backlog = self._place_key(stream_intake, facts)
        if backlog is None:
            shard = stream_intake.shard_map.shard_id(facts.hash_key)
            if shard is None:
                return None
            backlog = stream_intake.new_backlog(shard)
            facts.placed = version
            facts.backlog = backlog
        return backlog

    def _columns_fit(
        self,
        stream_intake: StreamIntake,
        facts_col: list[KeyFacts],
        sizes: list[int],
        held_by: dict[ShardBacklog, tuple[int, int]],
    ) -> bool:
        """Whether a column batch's items (placed: ``facts.backlog``) each fit now, checked in
        order as :meth:`_admit_run` checks records, each counted in before the next is
        checked; ``held_by`` gets each backlog's records and bytes with them in."""
        held_by.clear()
        count = self.outstanding.count
        nbytes = self.outstanding_bytes
        max_records = self.max_records
        max_bytes = self.max_bytes
        reserve_records = self.reserve_records
        reserve_bytes = self.reserve_bytes
        stream_bytes = stream_intake.outstanding_bytes
        path_bytes = at_most(stream_intake.path_bytes)
        path_share = at_least(stream_intake.path_share)
        for position, facts in enumerate(facts_col):
            backlog: ShardBacklog = facts.backlog  # type: ignore[assignment]  # (placed)
            now_held = held_by.get(backlog)
            if now_held is None:
                held, held_bytes = backlog.outstanding_records, backlog.outstanding_bytes
            else:
                held, held_bytes = now_held
            size = sizes[position]
            if not held:
                if count and (count >= max_records or nbytes + size > max_bytes):
                    return False
            elif (
                count >= reserve_records
                or nbytes + size > reserve_bytes
                or held >= backlog.full_records
                or held_bytes + size > backlog.full_bytes
                or (stream_bytes + size > path_bytes and held_bytes >= path_share)
            ):
                return False
            held_by[backlog] = (held + 1, held_bytes + size)
            count += 1
            nbytes += size
            stream_bytes += size
        return True

    def live_column_batches(self) -> list[ColumnBatch]:
        """The column batches with records not resolved yet."""
        self._prune_column_batches()
        return list(self.column_batches)

    def _prune_column_batches(self) -> None:
        """Drop the finished column batches (and their payload) from :attr:`column_batches`."""
        live = self.column_batches
        live[:] = [batch for batch in live if batch.counter.remaining]
        self.column_bytes = sum(batch.nbytes for batch in live)

    def take_all_items(self) -> None:
        """Every column batch's item not resolved yet taken over by the per-record path, into
        the outstanding list (the producer fails them: it is closing)."""
        for batch in self.live_column_batches():
            batch.take_unresolved()

    def finish_items(self, backlog: ShardBacklog, n: int, nbytes: int) -> None:
        """``n`` column items of ``backlog``, ``nbytes`` in all, succeeded (one Kinesis
        record's): counted out as :meth:`finish` counts out records."""
        self.outstanding.count -= n
        self.outstanding_bytes -= nbytes
        self._count_out(backlog, n, nbytes)
        self.on_finish()

    def checkpoint_due(self, stream_intake: StreamIntake) -> bool:
        """Whether the next admission that needs no wait should yield to the event loop first:
        every :data:`CHECKPOINT_EVERY` admissions, and always while the stream's shard map is
        not ready (ListShards must not wait behind a caller that never yields). The caller
        counts admissions in ``since_checkpoint`` and sets it to 0 when it yields.
        :meth:`admit_now` makes the same test inline."""
        return self.since_checkpoint + 1 >= CHECKPOINT_EVERY or not stream_intake.shard_map.ready

    def make_record(
        self,
        stream: object,
        data: object,
        partition_key: object,
        explicit_hash_key: object,
    ) -> Record:
        """Validate one record and build its handle (not yet admitted).

        :raises ~anykpl.errors.RecordTypeError: an argument of the wrong type.
        :raises ~anykpl.errors.InvalidRecordError: a value out of range.
        """
        if type(stream) is not str:
            raise errors.RecordTypeError(f"stream must be a str, not {type(stream).__name__}")
        payload = data if type(data) is bytes else _as_bytes(data)
        key: str
        random_key = partition_key is None
        if random_key:
            key = os.urandom(16).hex()
        elif type(partition_key) is not str:
            raise errors.RecordTypeError(
                f"partition_key must be a str, not {type(partition_key).__name__}"
            )
        else:
            key = partition_key
            if not key or len(key) > _limits.MAX_PARTITION_KEY_LENGTH:
                raise errors.InvalidRecordError(
                    f"partition_key must be 1..{_limits.MAX_PARTITION_KEY_LENGTH} characters, "
                    f"got {len(key)}"
                )
        if explicit_hash_key is None:
            facts = self.key_cache.get(key)
            if facts is None:
                # a random key comes once: not kept
                facts = _key_facts(key) if random_key else self.learn_key(key)
            size = len(payload) + facts.size
            if size > self.max_record_size:
                self._check_size(size)
            record = Record(stream, key, payload, facts.hash_key, None, 0.0, 0.0, 0.0, size, facts)
        else:
            size = len(payload) + len(_encoded_key(key))
            hash_key = _parse_explicit_hash_key(explicit_hash_key)
            self._check_size(size)
            record = Record(stream, key, payload, hash_key, str(hash_key), 0.0, 0.0, 0.0, size)
        if untrack_record is not None:  # the pure package (see Record)
            untrack_record(id(record))
        return record

    def learn_key(self, partition_key: str) -> KeyFacts:
        """The facts of a partition key the key cache does not hold, kept there from now on.

        :raises ~anykpl.errors.InvalidRecordError: a key out of range, or not valid Unicode.
        """
        if not partition_key or len(partition_key) > _limits.MAX_PARTITION_KEY_LENGTH:
            raise errors.InvalidRecordError(
                f"partition_key must be 1..{_limits.MAX_PARTITION_KEY_LENGTH} characters, "
                f"got {len(partition_key)}"
            )
        facts = _key_facts(partition_key)
        key_cache = self.key_cache
        if len(key_cache) >= KEY_CACHE_LIMIT:
            key_cache.clear()
        key_cache[partition_key] = facts
        return facts

    def _check_size(self, size: int) -> None:
        if size > self.max_record_size:
            raise errors.InvalidRecordError(
                f"record is {size} bytes (data + partition key), over the maximum of "
                f"{self.max_record_size} (max_user_record_size)"
            )

    def has_room(self, record: Record, stream: StreamIntake, recovered: bool = False) -> bool:
        """Whether ``record`` fits now: under the producer's caps, the reserve of them kept
        for quiet shards, its shard's backlog limit (its stream's while its shard is
        not known) and the spool's limit (see the module's docstring). An empty producer, or
        shard, always takes one record. A ``recovered`` one (already on disk) skips the spool's
        checks. Predicts the record's shard (``predicted_shard``) and sets the backlog it
        would be counted in (``backlog``), for :meth:`enqueue`."""
        size = record.size
        # StreamIntake.place, inline (one call less per record)
        shard = record.predicted_shard = stream.shard_map.shard_id(record.hash_key)
        if shard is None:
            backlog = stream.unplaced
        else:
            found = stream.backlogs.get(shard)
            backlog = stream.place(record) if found is None else found
        record.backlog = backlog
        outstanding = self.outstanding.count
        if outstanding:
            nbytes = self.outstanding_bytes + size
            if outstanding >= self.max_records or nbytes > self.max_bytes:
                return False
            held = backlog.outstanding_records
            if held:
                held_bytes = backlog.outstanding_bytes
                if backlog.shard is None:
                    if not stream.has_room(size, backlog):
                        return False
                elif held >= backlog.full_records or held_bytes + size > backlog.full_bytes:
                    return False  # the shard's own backlog limit (StreamIntake.has_room, inline)
                elif (
                    stream.outstanding_bytes + size > stream.path_bytes
                    and held_bytes >= stream.path_share
                ):
                    # what the network path has proven it delivers (StreamIntake.has_room)
                    stream.path_waits = True
                    return False
                if outstanding >= self.reserve_records or nbytes > self.reserve_bytes:
                    # The caps run short: the reserve is for quiet shards, those that hold
                    # less than an equal part of it with one more shard to come. Each may take
                    # at most that part, so some of it is always left for a shard that holds
                    # nothing yet, however many shards are hot.
                    shards = self.active_backlogs + 1
                    if (
                        held * shards >= self.reserved_records
                        or held_bytes * shards >= self.reserved_bytes
                    ):
                        return False
        spool = self.spool
        return (
            spool is None
            or recovered
            or (not self.recovering and (not outstanding or spool.has_room(size)))
        )

    def oldest_arrival(self) -> float | None:
        """When the oldest outstanding record was admitted (the producer's clock), ``None``
        when none is."""
        record = self.outstanding.oldest()
        oldest = None if record is None else record.arrival
        for batch in self.column_batches:  # the live column batches' too
            if batch.counter.remaining and (oldest is None or batch.arrival < oldest):
                oldest = batch.arrival
        return oldest

    def no_room_reason(self, record: Record, stream: StreamIntake) -> str:
        """What keeps ``record`` out now, in words (for
        :class:`~anykpl.errors.BackpressureTimeout`)."""
        size = record.size
        backlog = stream.place(record)
        outstanding = len(self.outstanding)
        spool = self.spool
        if spool is not None and self.recovering:
            return "the records recovered from the spool are admitted first"
        if spool is not None and outstanding and not spool.has_room(size):
            return (
                f"the spool holds {spool.bytes} bytes of spool_max_bytes={spool.max_bytes} "
                f"in {len(spool.segments)} segment(s)"
            )
        held = backlog.outstanding_records
        where = (
            f"stream {record.stream!r}"
            if backlog.shard is None
            else f"shard {backlog.shard} of stream {record.stream!r}"
        )
        if outstanding and held and not stream.has_room(size, backlog):
            if backlog.shard is None:
                held_records, held_bytes = stream.outstanding_records, stream.outstanding_bytes
                limit_records, limit_bytes = stream.backlog_records, stream.backlog_bytes
                whose = "its shards deliver"  # the shard map is not ready
            else:
                held_records, held_bytes = held, backlog.outstanding_bytes
                limit_records, limit_bytes = backlog.limit_records, backlog.limit_bytes
                whose = "the shard delivers"
            if held_records < limit_records and held_bytes + size <= limit_bytes:
                # not the shards' limit: what the path has proven
                return (
                    f"stream {record.stream!r} holds {stream.outstanding_bytes} bytes, about "
                    f"max_outstanding_time={stream.backlog_time:g} s of what the network path "
                    f"to Kinesis has delivered ({stream.path_bytes:.0f} bytes)"
                    + ("" if backlog.shard is None else f", {where} at least its part of it")
                )
            return (
                f"{where} holds {held_records} records / {held_bytes} bytes, about "
                f"max_outstanding_time={stream.backlog_time:g} s of what {whose} now"
            )
        caps = (
            f"{outstanding} records / {self.outstanding_bytes} bytes outstanding in the "
            f"producer (max_outstanding_records={self.max_records}, "
            f"max_outstanding_bytes={self.max_bytes})"
        )
        if outstanding >= self.max_records or self.outstanding_bytes + size > self.max_bytes:
            return caps
        return (
            f"{caps}; {where} holds {held} records / {backlog.outstanding_bytes} bytes, and "
            f"the last {RESERVE:.0%} of each cap is kept for shards that hold less than an "
            f"equal part of it ({self.active_backlogs} shards hold records)"
        )

    def enqueue(self, stream: StreamIntake, record: Record) -> None:
        """Admit ``record``: it is outstanding from now on (on disk first, with a spool), and in
        its stream's aggregator.

        :raises ~anykpl.errors.SpoolError: the spool could not take it; it was not admitted.
        """
        self.enqueue_at(stream, record, self.clock())

    def enqueue_at(self, stream: StreamIntake, record: Record, now: float) -> None:
        """:meth:`enqueue` with the clock already read (a batch reads it once).

        :raises ~anykpl.errors.SpoolError: the spool could not take it; it was not admitted.
        """
        spool = self.spool
        if spool is not None and record.spool_segment is None:
            spool.append(record)
        backlog = record.backlog
        if backlog is None:  # not checked by has_room (an admission that never waits)
            backlog = record.backlog = stream.place(record)
        # the record's clock starts at admission, as the KPL's starts when the daemon sees it
        record.arrival = now
        deadline = now + stream.max_buffered_time
        expiration = now + stream.record_ttl
        record.deadline = deadline if deadline < expiration else expiration
        record.expiration = expiration
        size = record.size
        # OutstandingRecords.add, inline (one call less per record)
        outstanding = self.outstanding
        slots = outstanding._records
        record.outstanding_slot = outstanding._base + len(slots)
        slots.append(record)
        outstanding.count += 1
        self.outstanding_bytes += size
        if not backlog.outstanding_records:
            self.active_backlogs += 1
        backlog.outstanding_records += 1
        backlog.outstanding_bytes += size
        stream.outstanding_records += 1
        stream.outstanding_bytes += size
        stream.received += 1
        stream.put(record)

    def finish(self, records: Sequence[Record], success: bool) -> tuple[int, int]:
        """Resolve the records still pending among ``records``; return how many there were,
        and their bytes."""
        spool = self.spool if not self.keep_spooled else None
        outstanding = self.outstanding
        # OutstandingRecords.remove, inline: its count of pending records kept exact, its
        # empty slots counted at the end (or before a completion hook, below), and the list
        # closed up after the loop
        slots = outstanding._records
        base = outstanding._base
        state = SUCCEEDED if success else FAILED
        # The loop counts only what is rare: the records resolved already (``skipped``) and
        # those not in the list (``kept``); how many were pending, and how many of them left
        # the list, follow from a record's position (``pending`` before it). The records of a
        # Kinesis record mostly count in one backlog (their shard's): a run of them is counted
        # out of it at once (from the ``run_from``-th pending record on), when the backlog
        # changes and at the end.
        skipped = kept = 0
        emptied_counted = 0  # of the records that left the list, those counted out of it
        released = 0
        run_backlog: ShardBacklog | None = None
        run_from = run_bytes = 0
        run_batch: BatchCounter | None = None
        batch_done = 0
        position = -1
        for position, record in enumerate(records):
            if record._state != PENDING:
                skipped += 1
                continue  # resolved already: exactly once
            slot = record.outstanding_slot - base
            try:
                if slot >= 0 and slots[slot] is record:
                    slots[slot] = None
                    record.outstanding_slot = -1
                else:
                    kept += 1  # not in the list (admitted by another intake, or never)
            except IndexError:
                kept += 1
            backlog = record.backlog
            if backlog is not run_backlog:
                pending = position - skipped
                if run_backlog is not None and pending > run_from:
                    self._count_out(run_backlog, pending - run_from, run_bytes)
                released += run_bytes
                run_backlog = backlog
                run_from = pending
                run_bytes = 0
            run_bytes += record.size
            if spool is not None:
                segment = record.spool_segment
                if segment is not None:
                    record.spool_segment = None
                    spool.finished(segment, success)
            if record.on_done is not None:
                if run_batch is not None:  # the batches' counts up to date for the hook
                    run_batch.records_done(batch_done, success)
                    run_batch = None
                # its completion hook runs now, and may read the list, admit records, or
                # resolve some itself (the list then closed up): the list is brought up to
                # date for it (the backlog's run counted out too), and read again after
                pending = position - skipped + 1  # this one included
                emptied = pending - kept - emptied_counted
                outstanding.count -= emptied
                outstanding._empty += emptied
                emptied_counted += emptied
                if run_backlog is not None and pending > run_from:
                    self._count_out(run_backlog, pending - run_from, run_bytes)
                released += run_bytes
                run_from = pending
                run_bytes = 0
                record.resolve(success)
                slots = outstanding._records
                base = outstanding._base
            elif record._event is None:
                # Record.resolve, when no task waits on the record itself; its batch's count
                # is taken down once for each run of the batch's records, the run before
                # counted out first (a batch's hook sees every record done counted)
                batch = record.batch
                if batch is not None:
                    if batch is run_batch:
                        batch_done += 1
                    else:
                        if run_batch is not None:
                            run_batch.records_done(batch_done, success)
                        run_batch = batch
                        batch_done = 1
                record._state = state
            else:
                if run_batch is not None:  # as before a completion hook
                    run_batch.records_done(batch_done, success)
                    run_batch = None
                record.resolve(success)
        if run_batch is not None:
            run_batch.records_done(batch_done, success)
        count = position + 1 - skipped
        if run_backlog is not None and count > run_from:
            self._count_out(run_backlog, count - run_from, run_bytes)
        released += run_bytes
        self.outstanding_bytes -= released
        emptied = count - kept - emptied_counted
        outstanding.count -= emptied
        outstanding._empty += emptied
        outstanding.close_up()
        self.on_finish()
        return count, released

    def _count_out(self, backlog: ShardBacklog, records: int, nbytes: int) -> None:
        """``records`` records of ``nbytes`` bytes that counted in ``backlog`` ended."""
        backlog.outstanding_records -= records
        backlog.outstanding_bytes -= nbytes
        if not backlog.outstanding_records:
            self.active_backlogs -= 1

    def place_unplaced(self, stream: StreamIntake) -> None:
        """``stream``'s shard map is ready: the records admitted while it was not (counted in
        ``unplaced``, under the stream's limit) count in their shards' backlogs from now on, so
        that a shard's limit bounds everything it holds. Scans the outstanding records only
        when some are unplaced (before the first map, and during a refresh)."""
        unplaced = stream.unplaced
        if not unplaced.outstanding_records:
            return
        shard_id = stream.shard_map.shard_id
        backlogs = stream.backlogs
        for record in self.outstanding:
            if record.backlog is not unplaced:
                continue
            shard = shard_id(record.hash_key)
            if shard is None:
                continue
            backlog = backlogs.get(shard)
            if backlog is None:
                backlog = stream.new_backlog(shard)
            size = record.size
            unplaced.outstanding_records -= 1
            unplaced.outstanding_bytes -= size
            if not backlog.outstanding_records:
                self.active_backlogs += 1
            backlog.outstanding_records += 1
            backlog.outstanding_bytes += size
            record.backlog = backlog
            if not unplaced.outstanding_records:
                self.active_backlogs -= 1
                break


class StreamIntake:
    """One stream's part of admission: its shards' backlogs, its own limit (for records whose
    shard is not known yet) and counts, and its aggregator."""

    def __init__(
        self,
        finish: Callable[[Sequence[Record], bool], tuple[int, int]],
        aggregator: Aggregator,
        shard_map: ShardMap,
        max_buffered_time: float,
        record_ttl: float,
        backlog_time: float,
        ship: Callable[[list[KinesisRecord]], object],
        wake: Callable[[], object],
        request_refresh: Callable[[], object],
        finish_items: Callable[[ShardBacklog, int, int], None] | None = None,
    ) -> None:
        # resolves records and returns how many were pending and their bytes (the producer's
        # Intake.finish)
        self._producer_finish = finish
        # counts out a Kinesis record's column items (the producer's Intake.finish_items);
        # a stream intake without it takes no column batch
        self._producer_finish_items = finish_items
        self.takes_columns = finish_items is not None
        self.aggregator = aggregator
        self.shard_map = shard_map
        self.max_buffered_time = max_buffered_time
        self.record_ttl = record_ttl
        # sends sealed Kinesis records to the Limiter; wakes the Aggregator's task (a record
        # with an earlier deadline); asks for a ListShards
        self.ship = ship
        self.wake = wake
        self.request_refresh = request_refresh
        # records admitted for this stream and not yet terminal, and the most it may hold
        # while the shard map is not ready (``max_outstanding_time``, planned by the pipeline)
        self.outstanding_records = 0
        self.outstanding_bytes = 0
        self.backlog_time = backlog_time
        self.backlog_records = math.inf
        self.backlog_bytes = math.inf
        # each predicted shard's backlog, and the limits a shard seen for the first time
        # starts with (its ceiling's worth, planned by the pipeline); the records admitted
        # before the shard map was ready count in ``unplaced``, under the stream's limit
        self.backlogs: dict[str, ShardBacklog] = {}
        self.new_shard_records = math.inf
        self.new_shard_bytes = math.inf
        # the most bytes the stream may hold that the network path has proven it delivers
        # (planned by the pipeline: NetworkWindow.admission_bytes), each open shard's equal
        # part of it (a shard holding less is not held back by it), and whether a record
        # waited for it since it was last planned (the pipeline plans it again as answers come)
        self.path_bytes = math.inf
        self.path_share = math.inf
        self.path_waits = False
        self.unplaced = ShardBacklog(None, math.inf, math.inf)
        self.received = 0  # user records admitted for this stream
        # the earliest deadline the Aggregator's task was told of (it plans its own wake-ups
        # from there on)
        self.wake_at = math.inf
        # adaptive batching: set by the pipeline while nothing is in flight or on its way to
        # the Sender; the next record then asks for what the stages hold to go at once
        # (``send_now``), and clears it
        self.idle = False
        self.send_now: Callable[[], object] = _nothing
        self._sealed: list[KinesisRecord] = []

    def place(self, record: Record) -> ShardBacklog:
        """Predict ``record``'s shard (``predicted_shard``) and return the backlog it counts
        in: its shard's, or ``unplaced`` while the shard map is not ready."""
        shard = record.predicted_shard = self.shard_map.shard_id(record.hash_key)
        if shard is None:
            return self.unplaced
        backlog = self.backlogs.get(shard)
        return self.new_backlog(shard) if backlog is None else backlog

    def new_backlog(self, shard: str) -> ShardBacklog:
        """The backlog of a shard seen for the first time, with a new shard's limits."""
        backlog = self.backlogs[shard] = ShardBacklog(
            shard, self.new_shard_records, self.new_shard_bytes
        )
        return backlog

    def has_room(self, size: int, backlog: ShardBacklog) -> bool:
        """Whether a record of ``size`` bytes fits in ``backlog``'s limit (a shard with
        nothing outstanding always takes one record), and in what the network path has
        proven it delivers (``path_bytes``, the stream's whole backlog; a shard that holds
        less than its equal part of it, ``path_share``, passes, so the stream holds less than
        twice it); for ``unplaced``, in the stream's limit and the path's (likewise for a
        stream with nothing outstanding)."""
        if backlog.shard is None:
            held = self.outstanding_records
            if not held:
                return True
            nbytes = self.outstanding_bytes + size
            if held >= self.backlog_records or nbytes > self.backlog_bytes:
                return False
            if nbytes > self.path_bytes:
                self.path_waits = True
                return False
            return True
        held = backlog.outstanding_records
        if not held:
            return True
        held_bytes = backlog.outstanding_bytes
        if held >= backlog.full_records or held_bytes + size > backlog.full_bytes:
            return False
        if self.outstanding_bytes + size > self.path_bytes and held_bytes >= self.path_share:
            self.path_waits = True
            return False
        return True

    def put(self, record: Record) -> None:
        """Hand an admitted record to the aggregator, and what it seals to the Limiter."""
        moved = self._aggregator().put_placed(record, self._sealed)
        self._handed(record.deadline if moved else math.inf)

    def put_runs(self, runs: dict[ShardBacklog, list[Record]]) -> None:
        """:meth:`put` for records admitted together, each shard's in order (``runs``: by
        their shards' backlogs), all with one deadline and one expiration, no tenant, under
        the key cache's facts (:meth:`Intake.admit_ready`): one call to the aggregator for
        each shard's."""
        aggregator = self._aggregator()
        deadline = math.inf
        for backlog, run in runs.items():
            if aggregator.put_run(backlog.shard, run, self._sealed):  # type: ignore[arg-type]
                deadline = run[0].deadline
        self._handed(deadline)

    def put_columns(self, columns: ColumnBatch) -> None:
        """:meth:`put_runs` for a column batch: each shard backlog's positions of it into its
        open aggregate."""
        aggregator = self._aggregator()
        moved = False
        sealed = self._sealed
        for backlog, run in columns.runs.items():
            if aggregator.put_items(backlog, columns, run, sealed):
                moved = True
        self._handed(columns.deadline if moved else math.inf)

    def finish_items(self, kr: KinesisRecord) -> None:
        """A Kinesis record of column items succeeded: its items counted out of the producer,
        their shard backlog and the stream."""
        n = kr.nitems
        nbytes = kr.item_bytes
        finish_items = self._producer_finish_items
        backlog = kr.item_backlog
        # (admit_columns' conditions: a stream intake with it, items placed in a backlog)
        assert finish_items is not None
        assert backlog is not None
        finish_items(backlog, n, nbytes)
        self.outstanding_records -= n
        self.outstanding_bytes -= nbytes

    def _aggregator(self) -> Aggregator:
        """The aggregator, for records about to be put: where ListShards failed for good (a
        missing stream) they go out raw and fail fast, and ListShards is tried again now
        records come (after its backoff)."""
        aggregator = self.aggregator
        if aggregator.map_unavailable and not self.shard_map.refresh_requested:
            self.shard_map.refresh_requested = True
            self.request_refresh()
        return aggregator

    def _handed(self, deadline: float) -> None:
        """Records were put: wake the aggregator's timer if ``deadline`` (the earliest one
        they may have brought forward; ``inf``: none) comes before it, ship what was sealed,
        and have an idle stream send what it holds."""
        if deadline < self.wake_at:
            self.wake_at = deadline
            self.wake()
        sealed = self._sealed
        if sealed:
            self._sealed = []
            self.ship(sealed)
        if self.idle:
            self.idle = False
            self.send_now()

    def finish(self, records: Sequence[Record], success: bool) -> None:
        """Resolve records of this stream (the Retrier's, and the producer's when it fails
        everything) and give their room back."""
        count, nbytes = self._producer_finish(records, success)
        self.outstanding_records -= count
        self.outstanding_bytes -= nbytes


def _nothing() -> None:
    return None


def offset_clock(base: Callable[[], float], offset: float) -> Callable[[], float]:
    """A clock that reads ``base() + offset``, as one call."""

    def clock() -> float:
        return base() + offset

    return clock


def _encoded_key(partition_key: str) -> bytes:
    try:
        return partition_key.encode()
    except UnicodeEncodeError as exc:
        raise errors.InvalidRecordError(f"partition_key is not valid Unicode: {exc}") from None


#: ``untrack_record`` for the key cache's entries: ``None`` where a ``KeyFacts`` is not tracked
#: to begin with (the compiled build), checked on its own type.
_untrack_key_facts: Final = gc_untracker(KeyFacts("", 0, 0, b""))


def _key_facts(partition_key: str) -> KeyFacts:
    """A partition key's hash key, UTF-8 length and key table entry."""
    encoded = _encoded_key(partition_key)
    facts = KeyFacts(
        partition_key, partition_key_hash(encoded), len(encoded), key_table_entry(encoded)
    )
    if _untrack_key_facts is not None:  # acyclic, like a record, and as long-lived in the cache
        _untrack_key_facts(id(facts))
    return facts


def _unpack_batch_record(item: object) -> tuple[object, object, object]:
    """(data, partition key, explicit hash key) of one item of :meth:`Producer.submit_many`."""
    if isinstance(item, tuple):
        size = len(item)
        if size == 2:
            return item[0], item[1], None
        if size == 1:
            return item[0], None, None
        if size == 3:
            return item[0], item[1], item[2]
    elif isinstance(item, (bytes, bytearray, memoryview)):
        return item, None, None
    raise errors.RecordTypeError(
        "each record is its data (bytes, bytearray or memoryview) or a tuple (data, "
        f"partition_key[, explicit_hash_key]), not {type(item).__name__}"
    )


def _as_bytes(data: object) -> bytes:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    if isinstance(data, str):
        raise errors.RecordTypeError(
            "data must be bytes, bytearray or memoryview, not str: encode it first "
            "(for example data.encode())"
        )
    raise errors.RecordTypeError(
        f"data must be bytes, bytearray or memoryview, not {type(data).__name__}"
    )


def _parse_explicit_hash_key(value: object) -> int:
    # Sizes are checked before any conversion: Python refuses to convert a str of more than
    # 4,300 digits to an int, or such an int to a str, and a hash key never needs more than 39.
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise errors.RecordTypeError(
            f"explicit_hash_key must be a decimal str or int, not {type(value).__name__}"
        )
    out_of_range = "explicit_hash_key must be in [0, 2**128 - 1]"
    number: int
    if isinstance(value, str):
        if not value.isascii() or not value.isdigit():
            shown = repr(value) if len(value) <= 60 else f"{value[:30]!r}... ({len(value)} chars)"
            raise errors.InvalidRecordError(
                f"explicit_hash_key must be a decimal integer, got {shown}"
            )
        digits = value.lstrip("0") or "0"
        if len(digits) > len(str(_limits.MAX_HASH_KEY)):
            raise errors.InvalidRecordError(
                f"{out_of_range}, got a decimal integer of {len(digits)} digits"
            )
        number = int(digits)
    else:
        number = value
    if not 0 <= number <= _limits.MAX_HASH_KEY:
        if number.bit_length() <= 256:
            raise errors.InvalidRecordError(f"{out_of_range}, got {number}")
        sign = "a negative" if number < 0 else "an"
        raise errors.InvalidRecordError(
            f"{out_of_range}, got {sign} integer of {number.bit_length()} bits"
        )
    return number
